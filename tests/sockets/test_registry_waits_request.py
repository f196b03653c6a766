"""The registry's `waits` request through its socket: the reply carries the hang limits, a deadlock reaches the
notifier as `kill_worker`, a raised calibration is saved before the reply, `status` shows the limits, and a bad
report is refused. The registry runs on a job it recovers from its store; discovery and the rendezvous are away
(its passes go blind), which `waits` does not need."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.bus.config import Endpoints, Timing
from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.notifier.service import NotifierService
from elastic_control_plane.services.registry.job import Job, Now
from elastic_control_plane.services.registry.service import RegistryService
from elastic_control_plane.services.registry.store import SqliteJobStore
from testing.harness import free_ports, wait_for


def _saved_running_job(tmp_path: Path) -> None:
    """A registry's store holding job 1 in round 1 on hosts a (slots 0, 1) and b (slot 0), every worker running."""
    job = Job.submitted(JobSpec.parse({"command": ["python", "train.py"], "hung_timeout": 120}), 1, now=0.0)
    job.begin_round(1, [["a", [0, 1]], ["b", [0]]], 1.0, {}, replacing=False)
    for host, local_rank, pid in (("a", 0, 100), ("a", 1, 101), ("b", 0, 110)):
        job.reports.record_started((host, local_rank), pid)
    job.ledger.released(time.monotonic(), 1, 3)  # training: a hang opens an interruption in the goodput ledger
    store = SqliteJobStore(tmp_path)
    saved = {
        "last_job_id": 1,
        "discovery_incarnation": None,
        "outbox": [],
        "job": job.to_saved(Now.read(time.monotonic)),
    }
    store.save(saved, job.unsaved_parts(Now.read(time.monotonic)))
    store.close()


@pytest.fixture
def registry(tmp_path: Path, notifier: NotifierService) -> Iterator[RegistryService]:
    _saved_running_job(tmp_path)
    away, port = (f"tcp://127.0.0.1:{p}" for p in free_ports(2)), free_ports(1)[0]
    peers = Endpoints(
        discovery=next(away),
        rendezvous=next(away),
        registry=f"tcp://127.0.0.1:{port}",
        notifier=notifier.endpoint,
        events=notifier.events.sock.getsockopt_string(zmq.LAST_ENDPOINT),
    )
    made: list[RegistryService] = []
    ready = threading.Event()

    def serve() -> None:
        """Made, run and closed in one thread: its SQLite connection is that thread's."""
        service = RegistryService(peers.registry, peers, Timing(), SqliteJobStore(tmp_path))
        made.append(service)
        ready.set()
        try:
            service.run()
        finally:
            service.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10), "the registry did not start"
    try:
        yield made[0]
    finally:
        made[0].stop()
        thread.join(timeout=5)


def slot(local_rank: int, pid: int, **values: Any) -> dict[str, Any]:
    return {
        "local_rank": local_rank,
        "pid": pid,
        "round": 1,
        "waiting_s": None,
        "busy_s": 0.1,
        "stalled_s": None,
        "waits": 10,
        "longest_wait_s": 0.0,
        "typical_busy_s": 0.0,
        "waited_total_s": 0.0,
        **values,
    }


def test_waits_are_answered_with_the_limits_a_stalled_rank_is_suspected_then_killed(
    registry: RegistryService, notifier: NotifierService, tmp_path: Path
) -> None:
    agent = Client(registry.endpoint, "test-agent", timeout=2.0, deadline=5.0)
    events = Client(notifier.endpoint, "test-reader", timeout=2.0, deadline=5.0)
    try:

        def published(kind: str) -> list[dict[str, Any]]:
            return [body for type_, body in events.request("since", {"seq": 0}).body["events"] if type_ == kind]

        def stalled_for(seconds: float) -> None:
            stuck = slot(1, 101, busy_s=seconds, stalled_s=seconds)
            assert agent.request("waits", {"host": "a", "slots": [slot(0, 100), stuck]}).body == {
                "limit_s": 30.0,
                "kill_s": 40.0,
                "upper_s": 120.0,
                "excuse_s": 3.0,
            }, "rank 1 is judged: the others may wait past the collective timeout"
            agent.request("waits", {"host": "b", "slots": [slot(0, 110, waiting_s=seconds + 0.1, busy_s=None)]})

        stalled_for(30.5)
        (suspect,) = wait_for(lambda: published("worker_suspected"), 10, "the worker_suspected event")
        assert (suspect["host"], suspect["local_rank"], suspect["pid"], suspect["kill_at_s"]) == ("a", 1, 101, 40.0)
        assert not published("kill_worker"), "suspected, not killed"
        (shown,) = agent.request("status").body["waits"]["suspected"]
        assert (shown["host"], shown["local_rank"], shown["pid"]) == ("a", 1, 101)

        stalled_for(40.1)
        (kill,) = wait_for(lambda: published("kill_worker"), 10, "the kill_worker event")
        assert {k: kill[k] for k in ("host", "local_rank", "pid", "dump_stack")} == {
            "host": "a",
            "local_rank": 1,
            "pid": 101,
            "dump_stack": True,
        }
        assert kill["reason"].startswith(
            "hung: the others waited 40.2s for rank 1 (limit 40.0s, no progress in its process tree for 40.1s)"
        )

        reply = agent.request("waits", {"host": "b", "slots": [slot(0, 110, longest_wait_s=8.0)]}).body
        assert (reply["limit_s"], reply["upper_s"]) == (40.0, 120.0)
        reader = SqliteJobStore(tmp_path)
        saved = reader.load()
        reader.close()
        assert saved is not None and saved[0]["job"]["wait_calibration"] == {"longest_wait_s": 8.0}, "saved before"
        assert saved[0]["job"]["hang_doublings"] == {"a:1": [1, 101]}, "the slot's next limits double"
        assert agent.request("status").body["waits"]["limit_s"] == 40.0

        with pytest.raises(ServiceError) as refused:
            agent.request("waits", {"host": "b", "slots": [slot(0, 110, waits=True)]})
        assert (refused.value.code, "slots[0].waits" in str(refused.value)) == ("bad_request", True)

        ledger = agent.request("ledger").body["goodput"]
        (hang,) = [entry for entry in ledger["interruptions"] if entry["cause"] == "hang"]
        assert hang["host"] == "a" and hang["reason"].startswith("hung: the others waited 40.2s for rank 1")
        assert set(ledger["hosts"]) == {"a"}, "the host the others waited for is charged, not the one that waited"
        for commit, field in (("7", "commit"), ({"commit": -1, "saving_s": 0.0}, "commit.commit")):
            with pytest.raises(ServiceError) as refused:
                agent.request("waits", {"host": "b", "slots": [slot(0, 110)], "commit": commit})
            assert refused.value.code == "bad_request" and field in str(refused.value), refused.value
        agent.request("waits", {"host": "b", "slots": [slot(0, 110)], "commit": {"commit": 3, "saving_s": 0.5}})
    finally:
        agent.close()
        events.close()
