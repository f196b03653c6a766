"""Write, then apply (issue 45): a drain, blacklist or configure whose marks etcd refuses leaves discovery as it was
and is answered `unavailable`; its retry, once etcd takes it, counts once; the registry sends a blacklist refused
for now again until discovery takes it. The store stands in for etcd refusing:
the election, the fence and the writes themselves are tested against a real etcd in
tests/integration/test_replicated_control_plane.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.bus.service import Service
from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.discovery.marks_log import MarksLogError
from elastic_control_plane.services.discovery.service import DiscoveryService
from elastic_control_plane.services.notifier.service import NotifierService
from elastic_control_plane.services.registry.driver import Driver
from elastic_control_plane.services.registry.job import Job
from elastic_control_plane.services.registry.peers import Peer
from testing.harness import free_ports, serve_in_thread


class RefusingMarks:
    """The marks' store: it refuses the next `refusals` saves, as etcd out of reach does, and keeps the others."""

    def __init__(self) -> None:
        self.refusals = 0
        self.saved: list[dict[str, Any]] = []

    def load(self) -> dict[str, Any]:
        return {}

    def save(self, marks: dict[str, Any]) -> None:
        if self.refusals:
            self.refusals -= 1
            raise MarksLogError("the host marks did not reach etcd: no reply")
        self.saved.append(marks)


@pytest.fixture
def marks() -> RefusingMarks:
    return RefusingMarks()


@pytest.fixture
def discovery(notifier: NotifierService, marks: RefusingMarks) -> Iterator[DiscoveryService]:
    service = DiscoveryService(
        f"tcp://127.0.0.1:{free_ports(1)[0]}",
        notifier.endpoint,
        Timing(heartbeat=30.0),
        marks_log=marks,  # type: ignore[arg-type]
    )
    yield from serve_in_thread(service)  # type: ignore[misc]


@pytest.fixture
def operator(discovery: DiscoveryService) -> Iterator[Client]:
    client = Client(discovery.endpoint, "test-operator", timeout=2.0, deadline=5.0)
    client.request("register", {"host": "h1", "slots": 2, "incarnation": "i"})
    yield client
    client.close()


def host_row(operator: Client) -> dict[str, Any]:
    (row,) = [row for row in operator.request("hosts").body["all"] if row["host"] == "h1"]
    return row


def test_a_refused_blacklist_takes_no_effect_and_its_retry_counts_once(
    discovery: DiscoveryService, operator: Client, marks: RefusingMarks
) -> None:
    marks.refusals = 1
    with pytest.raises(ServiceError) as refused:
        operator.request("blacklist", {"host": "h1", "reason": "crashed"})
    assert refused.value.code == "unavailable"
    record = discovery.hostset.hosts["h1"]
    assert (record.blacklist_count, record.blacklisted_until, host_row(operator)["state"]) == (0, None, "active")
    operator.request("blacklist", {"host": "h1", "reason": "crashed"})
    assert record.blacklist_count == 1 and marks.saved[-1]["h1"]["count"] == 1


def test_a_refused_drain_leaves_the_host_in_and_a_refused_configure_keeps_the_marks(
    discovery: DiscoveryService, operator: Client, marks: RefusingMarks
) -> None:
    marks.refusals = 1
    with pytest.raises(ServiceError, match="did not reach etcd"):
        operator.request("drain", {"host": "h1"})
    assert host_row(operator)["state"] == "active"
    operator.request("drain", {"host": "h1"})
    assert host_row(operator)["state"] == "draining"
    marks.refusals = 1
    with pytest.raises(ServiceError):
        operator.request("configure", {"discovery_script": None, "max_np": 3, "cooldown": [1, 2]})
    assert host_row(operator)["state"] == "draining" and discovery.max_np != 3, "nothing of it applied"


def test_the_registrys_blacklist_refused_for_now_is_sent_again_until_discovery_takes_it(
    discovery: DiscoveryService, operator: Client, marks: RefusingMarks
) -> None:
    registry = Service(f"tcp://127.0.0.1:{free_ports(1)[0]}")  # the driver's peer lives in a service's context
    peer = Peer(registry, discovery.endpoint, "test-registry")
    job = Job.submitted(JobSpec.parse({"command": ["python", "train.py"]}), 1, now=0.0)
    driver = Driver(job, peer, None, None, structlog.get_logger())  # type: ignore[arg-type]
    try:
        marks.refusals = 2
        driver.blacklist("h1", "slot 0 crashed 4 times")
        assert driver.unsent_blacklists == {"h1": "slot 0 crashed 4 times"}
        driver.send_unsent_blacklists(now=1.0)
        driver.send_unsent_blacklists(now=1.5)  # within a second: not sent again
        assert discovery.hostset.hosts["h1"].blacklist_count == 0 and marks.refusals == 0
        driver.send_unsent_blacklists(now=2.0)
        assert driver.unsent_blacklists == {} and discovery.hostset.hosts["h1"].blacklist_count == 1
        driver.blacklist("nobody", "unknown")
        assert driver.unsent_blacklists == {}, "a host discovery does not know is refused for good"
    finally:
        peer.close()
        registry.close()
