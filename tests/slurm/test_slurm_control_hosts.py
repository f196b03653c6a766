"""`elasticctl slurm --control-hosts 3` on a real 3-node Slurm: the control plane replicated on the job's three nodes
(an etcd member and a replica of each service per node, each in a step of its own); a control node that is not the
batch host set DOWN while the job trains: the two others keep the control plane, the job trains on and finishes with
every commit, and nothing of the job is left: no process, no etcd data, no certificate. A preempted job checkpoints,
requeues, and its rerun resumes from the checkpoint on a fresh replicated control plane."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from testing.harness import wait_for
from testing.slurm_cluster import SlurmCluster
from testing.slurm_cluster import slurm as run_slurm
from tests.slurm.test_slurm_jobs import BATCHES, commits, first_commit_at_size, job_args, preempt_and_resume


def job_processes(job: str) -> list[int]:
    """The processes Slurm started for `job` and their children, by SLURM_JOB_ID in their environment."""
    mark = f"\0SLURM_JOB_ID={job}\0".encode()
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if mark in b"\0" + (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def described(pids: list[int]) -> list[str]:
    """Each process as `pid: command line`, for a failure's message."""
    lines = []
    for pid in pids:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        lines.append(f"{pid}: {command[:200]}")
    return lines


def test_a_job_with_three_control_hosts_loses_a_control_node_and_finishes(slurm: SlurmCluster) -> None:
    job = slurm.submit(*job_args("log", flags=("--control-hosts", "3")))
    first_commit_at_size(slurm, 3, 0.0, 120)
    job_dir = slurm.user_dir / ".elastic-slurm" / job
    control = (job_dir / "control").read_text().strip().split(",")
    assert len(control) == 3 and f"control plane at {','.join(control)}:" in slurm.output(job)
    assert "control hosts on node1, node2, node3" in slurm.output(job)
    assert len(list(job_dir.glob("etcd-*"))) == 3 and (job_dir / "keys" / "etcd" / "ca.crt").exists()

    batch_host = re.search(r"BatchHost=(\S+)", run_slurm("scontrol", "show", "job", job)).group(1)
    victim = next(node for node in ("node3", "node2") if node != batch_host)
    down_at = time.time()
    subprocess.run(["scontrol", "update", f"NodeName={victim}", "State=DOWN", "Reason=test"], check=True)
    at_two = first_commit_at_size(slurm, 2, down_at, 60)

    assert slurm.wait_ended(job, 240) == "COMPLETED", slurm.output(job)[-3000:]
    assert slurm.exit_code(job) == "0:0"
    events = slurm.events("log")
    done = [e for e in events if e["event"] == "done"]
    assert done and all(e["batch"] == BATCHES and e["total"] == sum(range(BATCHES)) for e in done)
    assert victim not in {e["host"] for e in commits(events) if e["time"] >= at_two}
    try:
        wait_for(lambda: not job_processes(job), 30, f"every process of job {job} to end", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; left: {described(job_processes(job))}") from None
    assert not list(job_dir.glob("etcd-*")) and not (job_dir / "keys" / "etcd").exists()
    assert not (job_dir / "control-hosts").exists()


def test_a_preempted_job_with_three_control_hosts_resumes_on_a_fresh_replicated_control_plane(
    slurm: SlurmCluster,
) -> None:
    job = slurm.submit(*job_args("log", 400, flags=("--control-hosts", "3")))
    wait_for(lambda: len(commits(slurm.events("log"), size=3)) > 40, 120, "commits at world size 3", interval=0.2)
    preempt_and_resume(slurm, job)

    assert slurm.wait_ended(job, 180) == "COMPLETED", slurm.output(job)[-3000:]
    output = slurm.output(job)
    assert "run 1;" in output and output.count("control hosts on node1, node2, node3") == 2, output[-3000:]
    done = [e for e in slurm.events("log") if e["event"] == "done"]
    assert done and all(e["total"] == sum(range(400)) for e in done)
    try:
        wait_for(lambda: not job_processes(job), 30, f"every process of job {job} to end", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; left: {described(job_processes(job))}") from None
    job_dir = slurm.user_dir / ".elastic-slurm" / job
    assert not list(job_dir.glob("etcd-*")) and not (job_dir / "keys" / "etcd").exists()
