"""State that outlives its workers (issue 9): every worker of a job killed at once resumes from the hosts' snapshots;
services, agents and workers all killed, a new job on the same --checkpoint-dir resumes from the newest checkpoint;
the snapshots live in /dev/shm while the job runs and are gone after it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from elastic_control_plane.snapshot.durable import checkpoint_files
from testing.harness import Cluster, read_events, wait_for, worker_pid

SHM = Path("/dev/shm")
BATCHES = 240
COUNTER_JOB = [sys.executable, "tests/workers/counter.py", "--batches", str(BATCHES), "--step-delay", "0.02"]


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == kind]


def committed(log_dir: Path) -> int:
    return max((e["batch"] for e in events(log_dir, "commit")), default=0)


def agent_buffers(cluster: Cluster) -> list[Path]:
    """The snapshot buffers of this cluster's agents in /dev/shm."""
    pids = [p.pid for name, p in cluster.processes.items() if name.startswith("agent")]
    return [path for pid in pids for path in SHM.glob(f"elastic-snapshot-{pid}-*")]


def start(cluster: Cluster, log_dir: Path, *options: str) -> subprocess.Popen[bytes]:
    for host in ("host-1", "host-2"):
        cluster.start_agent(host, 1)
    return cluster.submit(
        "--min-np", "2", "--max-restarts", "3", *options, "--", *COUNTER_JOB, "--log-dir", str(log_dir)
    )


def assert_finished_exactly(log_dir: Path, ranks: int = 2, batches: int = BATCHES) -> None:
    done = events(log_dir, "done")
    assert len(done) == ranks, done
    assert {(e["batch"], e["total"]) for e in done} == {(batches, sum(range(batches)))}
    assert all(e["weights"] == done[0]["weights"] for e in done)


def test_every_worker_killed_at_once_resumes_from_the_snapshots_with_no_batch_lost_or_repeated(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, {"ELASTIC_SHM_DIR": str(SHM)})
    try:
        cluster.start_services()
        log_dir = tmp_path / "train"
        job = start(cluster, log_dir)
        wait_for(lambda: committed(log_dir) >= 40, 60, "40 commits")
        assert len(agent_buffers(cluster)) == 4, "each agent keeps two snapshot buffers in /dev/shm"
        victims = [worker_pid(cluster, host, 0) for host in ("host-1", "host-2")]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        last_before = committed(log_dir)
        assert cluster.wait_job_end(job, 120) == 0, cluster.output("elasticctl-run")
        entries = events(log_dir, "enter")
        resumed = [e for e in entries if e["pid"] not in victims]
        assert len({e["batch"] for e in resumed}) == 1, resumed
        assert last_before <= resumed[0]["batch"] <= last_before + 1, (
            "resumed at the newest commit (a kill may cut off the log line of the last one)"
        )
        assert_finished_exactly(log_dir)
        status = cluster.status()
        assert status["job"]["resumed_from"] == resumed[0]["batch"]
        assert any("every worker failed; resuming from the snapshot" in h["reason"] for h in status["history"])
        wait_for(lambda: not agent_buffers(cluster), 10, "the agents to remove their snapshots at job end")
    finally:
        cluster.close()


def test_a_new_job_on_the_same_checkpoint_dir_resumes_after_everything_was_killed(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    first = Cluster(tmp_path / "first", {"ELASTIC_SHM_DIR": str(SHM)})
    try:
        first.start_services()
        log_dir = tmp_path / "train-1"
        start(first, log_dir, "--checkpoint-dir", str(checkpoints), "--checkpoint-interval", "0.2")
        wait_for(
            lambda: (files := checkpoint_files(checkpoints)) and int(files[0].stem.split("-")[1]) >= 60,
            90,
            "a checkpoint of commit 60",
        )
        status = first.status()
        assert all(h["snapshot"]["commit"] >= 1 for h in status["hosts"]), status["hosts"]
    finally:
        for process in first.processes.values():
            process.send_signal(signal.SIGKILL)
        first.close()
    orphans = agent_buffers(first)
    killed_at = committed(log_dir)
    newest = int(checkpoint_files(checkpoints)[0].stem.split("-")[1])
    assert len(checkpoint_files(checkpoints, "host-1")) <= 2

    second = Cluster(tmp_path / "second", {"ELASTIC_SHM_DIR": str(SHM)})
    try:
        second.start_services()
        log_dir = tmp_path / "train-2"
        job = start(second, log_dir, "--checkpoint-dir", str(checkpoints), "--checkpoint-interval", "0.2")
        assert not [p for p in orphans if p.exists()], (
            "the next agent on the host removes the buffers a killed agent left"
        )
        assert second.wait_job_end(job, 120) == 0, second.output("elasticctl-run")
        first_entry = events(log_dir, "enter")[0]
        assert newest <= first_entry["batch"] <= killed_at and first_entry["batch"] > 0
        agents_output = second.output("agent-host-1") + second.output("agent-host-2")
        assert f"resuming from checkpoint {checkpoints}" in agents_output
        resumed = re.search(r"resuming from checkpoint \S+ \(job ([0-9a-f]{16}), commit (\d+)\)", agents_output)
        assert resumed and int(resumed.group(2)) >= newest, "the log names the job and the commit it resumed from"
        assert resumed.group(1) != second.job()["job_key"], "the job that wrote it: the first, not this one"
        assert_finished_exactly(log_dir)
        wait_for(lambda: not agent_buffers(second), 10, "the agents to remove their snapshots at job end")
    finally:
        second.close()


def test_a_job_whose_workers_all_die_again_at_the_same_commit_stops(cluster: Cluster, tmp_path: Path) -> None:
    log_dir = tmp_path / "train"
    for host in ("host-1", "host-2"):
        cluster.start_agent(host, 1)
    job = cluster.submit("--min-np", "2", "--", *COUNTER_JOB, "--crash-at", "30", "--log-dir", str(log_dir))
    assert cluster.wait_job_end(job, 90) == 1
    summary = cluster.job()
    assert summary["resumed_from"] == 30
    assert "all hosts failed again at commit 30, with no commit since the last resume" in summary["reason"]
    assert len({e["pid"] for e in events(log_dir, "enter")}) == 4, "one resume, then the job stops"


def test_a_respawned_worker_restores_from_its_hosts_snapshot(cluster: Cluster, tmp_path: Path) -> None:
    log_dir = tmp_path / "train"
    cluster.start_agent("host-1", 2)
    cluster.start_agent("host-2", 1)
    # Long enough that the job still trains when a replacement, importing torch on a loaded machine, is ready.
    batches = 3 * BATCHES
    job = cluster.submit("--min-np", "2", "--", *COUNTER_JOB, "--batches", str(batches), "--log-dir", str(log_dir))
    wait_for(lambda: committed(log_dir) >= 20, 60, "20 commits")
    victim = worker_pid(cluster, "host-1", 1)
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: len({e["pid"] for e in events(log_dir, "enter")}) == 4, 60, "the replacement to enter training")
    assert cluster.wait_job_end(job, 120) == 0
    assert "[host-1:1] libworker: restored commit" in cluster.output("agent-host-1")
    assert_finished_exactly(log_dir, ranks=3, batches=batches)
