"""replication/election.py's Leadership as a state machine: NEW -> STANDBY -> ACTIVE -> ENDED, one way out (`end`,
from any state, the first reason kept), and a `held()` that only reads: a lease past its time is not held, and says
why, without changing state. The elections themselves run against a real etcd in
tests/integration/test_replicated_control_plane.py; here a client that grants every lease stands in for it."""

from __future__ import annotations

import re
from typing import Any

import pytest

from elastic_control_plane.replication import election
from elastic_control_plane.replication.election import ACTIVE, ENDED, NEW, STANDBY, ElectionTiming, Leadership, LostRole


class GrantingClient:
    """Grants every lease for its TTL, keeps it alive, lets every campaign win and every write through."""

    def __init__(self) -> None:
        self.revoked: list[int] = []

    def lease_grant(self, ttl: int) -> tuple[int, int]:
        return 7, ttl

    def lease_keepalive(self, lease: int, deadline: float) -> int:
        return 1

    def sibling(self) -> GrantingClient:
        return self

    def close(self) -> None:
        return None

    def lease_revoke(self, lease: int, deadline: float) -> None:
        self.revoked.append(lease)

    def put(self, *args: Any, **kwargs: Any) -> None:
        return None

    def txn(self, *args: Any, **kwargs: Any) -> Any:
        return type("Result", (), {"succeeded": True, "revision": 42})()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def leadership(clock: Clock, client: GrantingClient) -> Leadership:
    return Leadership(
        client, "p", "registry", "a", "tcp://a:1", timing=ElectionTiming(100), clock=clock
    )  # a keepalive every 25 s: none here  # type: ignore[arg-type]


def test_a_replica_goes_new_standby_active_and_ends_once_with_its_first_reason() -> None:
    clock, client = Clock(), GrantingClient()
    role = leadership(clock, client)
    assert (role.state, role.held(), role.why_not_held()) == (NEW, False, "not registered")
    never = election.threading.Event()
    assert role.register(never) and (role.state, role.held()) == (STANDBY, True)
    assert role.campaign(never) and (role.state, role.revision) == (ACTIVE, 42)
    role.end("stopped", revoke=True)
    role.end("a second reason")
    assert (role.state, role.end_reason, role.held(), client.revoked) == (ENDED, "stopped", False, [7])
    with pytest.raises(LostRole, match="stopped"):
        role.write([])


def test_held_only_reads_a_lease_past_its_time_is_not_held_and_says_why() -> None:
    clock, client = Clock(), GrantingClient()
    role = leadership(clock, client)
    never = election.threading.Event()
    assert role.register(never) and role.campaign(never)
    clock.now += 100.0
    assert not role.held() and role.state == ACTIVE, "reading changes nothing"
    assert role.why_not_held() == "the lease was not renewed for 100 s (paused or cut off from etcd)"
    with pytest.raises(LostRole, match="not renewed"):
        role.write([])
    role.end(role.why_not_held())
    assert role.state == ENDED and client.revoked == []


def test_a_leadership_that_ended_never_comes_back() -> None:
    role = leadership(Clock(), GrantingClient())
    role.end("stopped before it registered")
    never = election.threading.Event()
    with pytest.raises(RuntimeError, match="cannot go from ended to standby"):
        role.register(never)


@pytest.mark.parametrize(
    "timing, problem",
    [
        ({"lease_s": 0}, "the lease must be a whole number of seconds, at least 1 (got 0)"),
        ({"lease_s": 1, "retry_s": 0.5}, "an election needs lease (1 s) > two keepalives (0.5 s) > retry (0.5 s) > 0"),
        ({"lease_s": 1, "least_write_s": 2.0}, "a fenced write's least deadline and the revoke's must lie within"),
    ],
)
def test_an_elections_intervals_are_checked_together(timing: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        ElectionTiming(**timing)
