"""Clean ends (issue 24): every worker of a finished job exits 0, nothing after the job's end counts as a failure.

The Horovod example and the elastic example run to the end on 2 hosts x 2
slots, with and without a standby per host, with and without a worker
SIGKILLed mid-job (a reset). Whatever the variant: the job succeeds, every
worker the agents saw exit did so with code 0 (but the one killed), the only
restart is the killed slot's, and no line of any output says `terminate
called` (what a C++ thread left joinable at exit prints before SIGABRT).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from testing.harness import Cluster, wait_for

HOSTS = ("host-1", "host-2")
HOROVOD = [sys.executable, "examples/horovod_elastic.py", "--epochs", "3", "--samples", "512", "--step-delay", "0.05"]
ELASTIC = [sys.executable, "examples/train_elastic.py", "--epochs", "3", "--samples", "512", "--step-delay", "0.02"]


def agent_events(cluster: Cluster, event: str) -> list[dict[str, Any]]:
    found = []
    for host in HOSTS:
        for line in cluster.output(f"agent-{host}").splitlines():
            if f'"event": "{event}"' in line and line.startswith("{"):
                found.append(json.loads(line))
    return found


def training_pids(cluster: Cluster) -> list[int]:
    job = cluster.call("registry", "status")
    return [int(w["pid"]) for w in job["workers"] if w["state"] == "RUNNING" and w["pid"]] if job["size"] == 4 else []


@pytest.mark.parametrize(
    ("command", "standby", "reset"),
    [(HOROVOD, 1, False), (HOROVOD, 0, True), (ELASTIC, 1, True), (ELASTIC, 0, False)],
    ids=["horovod-standby", "horovod-reset", "elastic-standby-reset", "elastic"],
)
def test_every_worker_of_a_finished_job_exits_0(
    cluster: Cluster, tmp_path: Path, command: list[str], standby: int, reset: bool
) -> None:
    for host in HOSTS:
        cluster.start_agent(host, 2, ["--standby", str(standby)] if standby else None)
    job = cluster.submit(
        "--min-np", "2", "--", *command, *(["--log-dir", str(tmp_path / "train")] if command is ELASTIC else [])
    )
    killed = []
    if reset:
        victim = wait_for(lambda: training_pids(cluster), 60, "4 workers training")[-1]
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    for host in HOSTS:
        assert cluster.stop(f"agent-{host}", signal.SIGTERM, timeout=30) == 0
    exited = agent_events(cluster, "worker_exited")
    exits = {e["pid"]: e["exit_code"] for e in exited}
    assert len(exits) >= 4
    assert {pid: code for pid, code in exits.items() if pid not in killed} == dict.fromkeys(set(exits) - set(killed), 0)
    assert [exits[pid] for pid in killed] == [-9] * len(killed)
    # A crashed slot may be logged as restarting and then taken by a standby that became ready during its back-off:
    # what counts is which slots were restarted, and that each killed slot had exactly one replacement process.
    restarts = agent_events(cluster, "slot_restarting") + agent_events(cluster, "standby_admitted")
    killed_slots = {(e["host"], e["local_rank"]) for e in exited if e["pid"] in killed}
    assert {(e["host"], e["local_rank"]) for e in restarts} == killed_slots, restarts
    for slot in killed_slots:
        assert len([e for e in exited if (e["host"], e["local_rank"]) == slot]) == 2, exited
    outputs = "".join(cluster.output(name) for name in ("elasticctl-run", *(f"agent-{host}" for host in HOSTS)))
    assert "terminate called" not in outputs
    assert "worker_died_after_its_script_ended" not in outputs


def test_a_worker_killed_in_teardown_after_its_script_ended_is_finished_not_a_crash(cluster: Cluster) -> None:
    for host in HOSTS:
        cluster.start_agent(host, 1)
    job = cluster.submit("--min-np", "2", "--", sys.executable, "tests/workers/abort_in_teardown.py")
    assert cluster.wait_job_end(job, 60) == 0, cluster.output("elasticctl-run")
    assert "allreduce gave [2.0, 2.0, 2.0]" in cluster.output("agent-host-1")
    died = agent_events(cluster, "worker_died_after_its_script_ended")
    assert [e["signal"] for e in died] == [signal.SIGABRT] * 2
    assert not agent_events(cluster, "slot_restarting")
    reasons = {w["reason"] for w in cluster.call("registry", "status")["workers"]}
    assert reasons == {f"its script ended, then it died of signal {int(signal.SIGABRT)} in interpreter teardown"}
