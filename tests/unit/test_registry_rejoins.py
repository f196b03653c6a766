"""The registry's reading of the rounds and hosts, driven without processes: the rendezvous's rejoins read from a
cursor kept by the driver, a release recording every worker, lost hosts and restarted agents failing their slots,
and an idle pass that changes nothing and saves nothing; a host lost on Slurm's word is dated when found."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import structlog

from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.registry.driver import Driver
from elastic_control_plane.services.registry.hosts import restarted_agents
from elastic_control_plane.services.registry.job import Job, Now
from elastic_control_plane.services.registry.reports import FAILURE, READY, RUNNING
from elastic_control_plane.services.registry.store import SqliteJobStore

HOSTS = [["a", [0, 1]], ["b", [0]]]


class Outbox:
    def __init__(self) -> None:
        self.queued: list[tuple[str, dict[str, Any]]] = []

    def put(self, event: str, data: dict[str, Any]) -> None:
        self.queued.append((event, data))


def running_driver() -> Driver:
    job = Job.submitted(JobSpec.parse({"command": ["python", "train.py"]}), 1, now=0.0)
    job.begin_round(1, HOSTS, 1.0, {}, replacing=False)
    return Driver(job, None, None, Outbox(), structlog.get_logger())  # type: ignore[arg-type]


def status(**body: Any) -> dict[str, Any]:
    """The rendezvous's `status` answer for round 1, released."""
    return {"round": 1, "released": True, "size": 3, "parked": 0, "pids": [], "rejoins": [], "rejoins_next": 0, **body}


HOSTS_READ = {"timestamp": 1.0, "lost": [], "agents": {}}


def test_the_release_starts_every_worker_and_the_rejoins_are_read_from_the_cursor() -> None:
    driver = running_driver()
    assert driver.status_query(pids=True) == {"round": 0, "rejoins_from": 0, "pids": True}, "a new driver: from 0"
    pids = [["a", 0, 100], ["a", 1, 101], ["b", 0, 110]]
    driver.drive(HOSTS_READ, status(pids=pids, rejoins=[["a", 1, 101, 1]], rejoins_next=1), now=2.0)
    reports = driver.job.reports
    assert (reports[("a", 0)].state, reports[("a", 1)].state, reports[("b", 0)].pid) == (RUNNING, READY, 110)
    assert driver.status_query(pids=False) == {"round": 1, "rejoins_from": 1, "pids": False}
    assert driver.drive(HOSTS_READ, status(rejoins=[["a", 0, 100, 1], ["b", 0, 110, 1]], rejoins_next=3), now=3.0)
    assert driver.status_query(pids=False)["rejoins_from"] == 3


def test_a_rejoin_read_twice_or_of_an_older_round_changes_nothing() -> None:
    driver = running_driver()
    driver.drive(HOSTS_READ, status(pids=[["a", 0, 100], ["a", 1, 101], ["b", 0, 110]]), now=2.0)
    driver.drive(HOSTS_READ, status(rejoins=[["a", 0, 100, 1]], rejoins_next=1), now=3.0)
    unchanged = driver.job.unsaved_parts(Now(local=3.0, wall=1_700_000_000.0))
    driver.job.saved(unchanged)
    driver.drive(HOSTS_READ, status(rejoins=[["a", 0, 100, 1], ["b", 0, 110, 0]], rejoins_next=2), now=4.0)
    assert driver.job.reports[("b", 0)].state == RUNNING, "a join after round 0 is no rejoin of round 1"
    assert driver.job.unsaved_parts(Now(local=4.0, wall=1_700_000_001.0)) == {}


def test_an_idle_pass_saves_nothing(tmp_path: Path) -> None:
    """A running round where nothing happens: the pass changes no report, and the save writes nothing (however the
    clocks jitter between two readings)."""
    driver = running_driver()
    driver.drive(HOSTS_READ, status(pids=[["a", 0, 100], ["a", 1, 101], ["b", 0, 110]]), now=2.0)
    store = SqliteJobStore(tmp_path)
    saved_at = Now(local=10.0, wall=1_700_000_000.0)
    parts = driver.job.unsaved_parts(saved_at)
    assert store.save({"job": driver.job.to_saved(saved_at)}, parts)
    driver.job.saved(parts)
    assert not driver.drive(HOSTS_READ, status(), now=3.0)
    jittered = Now(local=20.0, wall=1_700_000_010.00001)
    assert driver.job.unsaved_parts(jittered) == {}
    assert not store.save({"job": driver.job.to_saved(jittered)}, driver.job.unsaved_parts(jittered))
    store.close()


def test_an_idle_pass_over_32768_slots_does_no_work_per_slot() -> None:
    """4,096 hosts x 8, every worker running: a thousand idle passes take well under a second."""
    job = Job.submitted(JobSpec.parse({"command": ["python", "train.py"]}), 1, now=0.0)
    hosts = [[f"host-{h}", list(range(8))] for h in range(4096)]
    job.begin_round(1, hosts, 1.0, {}, replacing=False)
    driver = Driver(job, None, None, Outbox(), structlog.get_logger())  # type: ignore[arg-type]
    driver.drive(HOSTS_READ, status(pids=[[h, s, 1] for h, slots in hosts for s in slots]), now=2.0)
    job.saved(job.unsaved_parts(Now(local=2.0, wall=1_700_000_000.0)))
    began = time.process_time()
    for tick in range(1000):
        driver.drive(HOSTS_READ, status(), now=3.0 + tick)
        assert job.unsaved_parts(Now(local=3.0 + tick, wall=1_700_000_001.0 + tick)) == {}
    assert time.process_time() - began < 1.0


def test_restarted_agents_are_the_live_ones_whose_incarnation_changed() -> None:
    known = {"a": "agent:1", "b": "agent:2", "gone": "agent:3"}
    live = {"a": "agent:1", "b": "agent:9", "new": "agent:4", "odd": ["not", "a", "string"]}
    assert restarted_agents({"agents": live}, known) == {"b", "new"}
    assert restarted_agents({"agents": dict(known)}, known) == set()
    assert restarted_agents({}, known) == set()


def test_the_silent_slots_of_a_lost_host_and_of_a_restarted_agent_fail_in_rank_order() -> None:
    job = Job.submitted(JobSpec.parse({"command": ["python", "train.py"]}), 1, now=0.0)
    job.begin_round(1, [["c", [0]], ["a", [1, 0]], ["b", [0]]], 1.0, {"a": "agent:a", "b": "agent:b"}, False)
    driver = Driver(job, None, None, Outbox(), structlog.get_logger())  # type: ignore[arg-type]
    driver.drive({**HOSTS_READ, "agents": {"a": "agent:a", "b": "agent:b"}}, status(), now=2.0)
    assert job.reports.count(FAILURE) == 0
    read = {**HOSTS_READ, "lost": ["b", "elsewhere"], "agents": {"a": "agent:a2", "c": "agent:c"}}
    driver.drive(read, status(), now=3.0)
    failed = [(slot, report.failed_order, report.host_stays) for slot, report in job.reports.failures()]
    assert failed == [(("c", 0), 1, True), (("a", 1), 2, True), (("a", 0), 3, True), (("b", 0), 4, False)]


def test_a_host_lost_on_slurms_word_fails_at_once_and_its_fault_is_dated_when_found() -> None:
    """A lost host's fault is dated its last heartbeat (`lost_after` earlier); one discovery's source declared gone
    (a Slurm node DOWN: `lost_declared`) is dated when it was found, and says so."""
    for lost, declared, reason, at in (
        (["b"], [], "host lost (missed heartbeats)", 10.0 - 3.0),
        (["b"], ["b"], "host lost (its node is down, as Slurm says)", 10.0),
    ):
        driver = running_driver()
        driver.lost_after = 3.0
        driver.drive(HOSTS_READ, status(pids=[["a", 0, 100], ["a", 1, 101], ["b", 0, 110]]), now=2.0)
        driver.drive({**HOSTS_READ, "lost": lost, "lost_declared": declared}, status(), now=10.0)
        assert [(slot, report.reason) for slot, report in driver.job.reports.failures()] == [(("b", 0), reason)]
        interruption = driver.job.ledger.interruption
        assert interruption is not None and interruption["reason"] == reason
        assert interruption["at"] == at
