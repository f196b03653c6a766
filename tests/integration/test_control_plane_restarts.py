"""A control plane that may die (issue 10): kill -9 of any one service, or of all four at once, while a job trains,
and the same command started again seconds later. Training never stops, the registry answers for the same job
and round, no reset is spent on the outage, and a worker killed afterwards is recovered: the job ends with exit 0
and the totals of a run without failures (no commit lost, none repeated)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.harness import SERVICES, Cluster, free_ports, wait_for
from tests.integration.test_snapshots import BATCHES, assert_finished_exactly, committed
from tests.integration.training import worker_pid

OUTAGE = 2.0  # seconds between the kill and the restart, as a supervisor (compose's `restart:`) would take

JOB = [sys.executable, "tests/workers/counter.py", "--batches", str(BATCHES), "--step-delay", "0.03"]


def start_job(cluster: Cluster, log_dir: Path) -> subprocess.Popen[bytes]:
    for host in ("host-1", "host-2"):
        cluster.start_agent(host, 1)
    return cluster.submit("--min-np", "2", "--", *JOB, "--log-dir", str(log_dir))


@pytest.mark.parametrize("killed", [(s,) for s in SERVICES] + [SERVICES], ids=[*SERVICES, "all-four"])
def test_a_killed_service_restarted_mid_job_costs_no_reset_and_no_commit(cluster: Cluster, tmp_path: Path, killed: tuple[str, ...]) -> None:
    log_dir = tmp_path / "train"
    run = start_job(cluster, log_dir)
    wait_for(lambda: committed(log_dir) >= 20 and cluster.job()["state"] == "running", 60, "the job to train")
    before = cluster.job()

    for name in killed:
        cluster.processes[name].send_signal(signal.SIGKILL)
    for name in killed:
        cluster.processes[name].wait(timeout=10)
    at_kill = committed(log_dir)
    time.sleep(OUTAGE)  # the outage itself is what is tested
    assert committed(log_dir) > at_kill, "training went on while the control plane was away"
    if "registry" not in killed:
        assert cluster.job()["job"] == before["job"], "the registry answers for the job during the outage"
    cluster.start_services(services=killed)

    job = cluster.job()
    assert (job["job"], job["job_key"], job["state"]) == (before["job"], before["job_key"], "running"), job
    after_restart = committed(log_dir)
    wait_for(lambda: committed(log_dir) >= after_restart + 10, 30, "training to go on after the restart")
    job = cluster.job()
    assert (job["round"], job["resets"]) == (before["round"], before["resets"]), f"no reset for the outage: {before} -> {job}"
    assert {h["host"] for h in cluster.call("discovery", "hosts")["all"] if h["state"] == "active"} == {"host-1", "host-2"}

    os.kill(worker_pid(cluster, "host-2", 0), signal.SIGKILL)
    assert cluster.wait_job_end(run, 120) == 0, cluster.output("elasticctl-run")
    assert_finished_exactly(log_dir)
    job = cluster.job()
    assert job["state"] == "succeeded" and job["resets"] > before["resets"], job
    assert "unreachable" not in cluster.output("elasticctl-run") or "registry" in killed


def test_the_registry_refuses_a_state_directory_it_cannot_read(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "registry.sqlite3").write_bytes(b"this is not a database" * 100)
    env = {**os.environ, "ELASTIC_REGISTRY_ENDPOINT": f"tcp://127.0.0.1:{free_ports(1)[0]}"}
    result = subprocess.run([sys.executable, "-m", "services.registry", "--state-dir", str(state_dir)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "registry.sqlite3" in lines[0], result.stderr
