"""replication/space.py's bound on reclaiming etcd's space: a reclaim that frees space may be followed by another at
once; one that frees nothing (etcd full of live data) holds the next back for RECLAIM_BACKOFF_S, said once."""

from __future__ import annotations

from typing import Any

import structlog

from elastic_control_plane.replication.space import RECLAIM_BACKOFF_S, SpaceReclaims


class Backends:
    """What EtcdClient.reclaim_space answers, in turn: (largest backend before, after)."""

    def __init__(self, *answers: tuple[int, int]) -> None:
        self.answers, self.calls = list(answers), 0

    def reclaim_space(self) -> tuple[int, int]:
        self.calls += 1
        return self.answers.pop(0)


def test_a_reclaim_that_frees_nothing_holds_the_next_back_and_says_so_once() -> None:
    now = [0.0]
    reclaims = SpaceReclaims(clock=lambda: now[0])
    client: Any = Backends((1000, 100), (1000, 990), (1000, 500))
    with structlog.testing.capture_logs() as logs:
        assert reclaims.reclaim(client, structlog.get_logger())  # history freed: innocent
        assert reclaims.reclaim(client, structlog.get_logger())  # full of live data
        for _ in range(5):
            now[0] += RECLAIM_BACKOFF_S / 10
            assert not reclaims.reclaim(client, structlog.get_logger()), "held back within the backoff"
        now[0] += RECLAIM_BACKOFF_S
        assert reclaims.reclaim(client, structlog.get_logger()), "tried again after it"
    assert client.calls == 3
    assert [entry["event"] for entry in logs].count("etcd_full_of_live_data") == 1
    assert [entry["event"] for entry in logs].count("etcd_space_reclaimed") == 3
