"""Write, then apply, in the rendezvous (issue 45): a new job's reset whose clear etcd refused changes nothing (the
old job's round and keys stay, answered `unavailable`); its retry, once etcd takes the clear, resets."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.services.rendezvous.kv_log import KvLogError
from elastic_control_plane.services.rendezvous.service import RendezvousService
from testing.harness import free_ports, serve_in_thread


class RefusingKvLog:
    """The keys' log in etcd: it refuses the next `refusals` clears, as etcd out of reach does, and keeps the rest."""

    def __init__(self) -> None:
        self.refusals = 0
        self.clears = 0

    def load(self) -> dict[str, bytes]:
        return {}

    def set(self, key: str, value: bytes) -> None:
        pass

    def drop_prefixes(self, prefixes: list[str]) -> None:
        pass

    def clear(self) -> None:
        if self.refusals:
            self.refusals -= 1
            raise KvLogError("the store's write did not reach etcd: no reply")
        self.clears += 1


@pytest.fixture
def kv_log() -> RefusingKvLog:
    return RefusingKvLog()


@pytest.fixture
def rendezvous(kv_log: RefusingKvLog) -> Iterator[RendezvousService]:
    service = RendezvousService(f"tcp://127.0.0.1:{free_ports(1)[0]}", kv_log=kv_log)  # type: ignore[arg-type]
    yield from serve_in_thread(service)  # type: ignore[misc]


def test_a_reset_whose_clear_etcd_refused_leaves_the_old_job_and_its_retry_resets(
    rendezvous: RendezvousService, kv_log: RefusingKvLog
) -> None:
    admin = Client(rendezvous.endpoint, "test-registry", timeout=1.0, deadline=5.0)
    try:
        admin.request("new_round", {"hosts": [["a", 1]], "min_np": 1, "max_np": None, "hosts_timestamp": 1.0})
        assert admin.request("status").body["round"] == 1
        kv_log.refusals = 1
        with pytest.raises(ServiceError) as refused:
            admin.request("reset")
        assert refused.value.code == "unavailable"
        assert admin.request("status").body["round"] == 1, "the refused reset changed nothing"
        admin.request("reset")
        assert (admin.request("status").body["round"], kv_log.clears) == (0, 1)
    finally:
        admin.close()


def test_a_replica_not_yet_given_its_round_lets_no_one_set_a_key_then_only_rank_0s_host(
    rendezvous: RendezvousService,
) -> None:
    """Issue 58: after a failover and before the registry restored the round, any agent could set the round's store
    address. Now nobody can (`unavailable`: rank 0 sends it again), and once the round is back only its rank 0's host
    can."""
    admin = Client(rendezvous.endpoint, "test-registry", timeout=1.0, deadline=5.0)
    agent = Client(rendezvous.endpoint, "test-agent", timeout=1.0, deadline=5.0)
    try:
        with pytest.raises(ServiceError) as refused:
            agent.request("kv_set", {"key": "round/1/store", "host": "b"}, raw=(b"b:1",))
        assert refused.value.code == "unavailable"
        restored = {"round": 1, "hosts": [["a", 1], ["b", 1]], "hosts_timestamp": 1.0, "released": False, "pids": []}
        admin.request("restore_round", restored)
        with pytest.raises(ServiceError) as forbidden:
            agent.request("kv_set", {"key": "round/1/store", "host": "b"}, raw=(b"b:1",))
        assert forbidden.value.code == "forbidden"
        agent.request("kv_set", {"key": "round/1/store", "host": "a"}, raw=(b"a:1",))
        assert rendezvous.kv == {"round/1/store": b"a:1"}
    finally:
        admin.close()
        agent.close()
