"""Elastic jobs on a real 3-node Slurm (issue 48), submitted with `elasticctl slurm` from a user's own directory:
a job trains across the three nodes, loses one set DOWN by the admin and one whose slurmd and agent are SIGKILLed,
trains on within seconds on what is left and finishes with every commit; a node lost while a job starts does not
hold its start; a second allocation joins a running job and leaves it; a preemption signal checkpoints, requeues,
and the rerun resumes from the checkpoint with no committed step lost; two jobs' batch scripts share a host."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

from elastic_control_plane.slurm.requeue import REQUEUE
from testing.harness import wait_for
from testing.slurm_cluster import SlurmCluster, kill_node
from testing.slurm_cluster import slurm as run_slurm

BATCHES = 600
STEP = 0.05
LOSS_BUDGET = 10.0  # seconds from a node's loss to commits at the smaller size (bench/slurm.py measures it closely)


def job_args(
    log_dir: str, batches: int = BATCHES, nodes: int = 3, flags: tuple[str, ...] = (), checkpoint_every: float = 2
) -> list[str]:
    return [
        "-N",
        str(nodes),
        *flags,
        "--checkpoint-interval",
        str(checkpoint_every),
        "--",
        "python",
        "counter.py",
        "--batches",
        str(batches),
        "--step-delay",
        str(STEP),
        "--log-dir",
        log_dir,
    ]


def commits(events: list[dict[str, Any]], **where: Any) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "commit" and all(e.get(k) == v for k, v in where.items())]


def first_commit_at_size(slurm: SlurmCluster, size: int, after: float, timeout: float) -> float:
    """When the first commit at world size `size` after `after` was made."""
    found = wait_for(
        lambda: [e["time"] for e in commits(slurm.events("log"), size=size) if e["time"] > after],
        timeout,
        f"commits at world size {size}",
        interval=0.1,
    )
    return min(found)


def discovery_events(slurm: SlurmCluster, job: str, name: str) -> list[dict[str, Any]]:
    """Discovery's log events `name` of the job's first run, each with its wall-clock `time`."""
    events = []
    for line in (slurm.user_dir / ".elastic-slurm" / job / "logs" / "discovery-0.log").read_text().splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") == name:
            when = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00"))
            events.append({**event, "time": when.timestamp()})
    return events


def discovery_removed(slurm: SlurmCluster, job: str, before: float) -> set[str]:
    """Every host discovery's hosts_updated events took out of the job before the wall-clock time `before`."""
    updates = discovery_events(slurm, job, "hosts_updated")
    return {host for event in updates if event["time"] < before for host in event.get("remove") or []}


def test_a_job_trains_on_three_nodes_survives_a_node_set_down_and_a_killed_node_and_finishes(
    slurm: SlurmCluster,
) -> None:
    job = slurm.submit(*job_args("log"), env={"ELASTIC_SLURM_POLL": "0.5"})  # Slurm's word before the heartbeats'
    first_commit_at_size(slurm, 3, 0.0, 120)

    down_at = time.time()
    subprocess.run(["scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=test"], check=True)
    at_two = first_commit_at_size(slurm, 2, down_at, 60)
    assert at_two - down_at < LOSS_BUDGET, f"{at_two - down_at:.1f}s from node2 DOWN to training on two nodes"

    killed_at = time.time()
    kill_node("node3")
    at_one = first_commit_at_size(slurm, 1, killed_at, 60)
    assert at_one - killed_at < LOSS_BUDGET, f"{at_one - killed_at:.1f}s from node3's kill to training on node1"

    assert slurm.wait_ended(job, 180) == "COMPLETED", slurm.output(job)[-3000:]
    assert slurm.exit_code(job) == "0:0"
    events = slurm.events("log")
    done = [e for e in events if e["event"] == "done"]
    assert done and all(e["batch"] == BATCHES and e["total"] == sum(range(BATCHES)) for e in done)
    # Innocent: until the job finished, node1 was never taken out; only the nodes lost were.
    assert discovery_removed(slurm, job, before=min(e["time"] for e in done)) == {"node2", "node3"}
    # node2 was lost on Slurm's word (DOWN), at once; node3's slurmd died with its agent: its heartbeats told first.
    lost = {e["host"]: e.get("reason", "missed heartbeats") for e in discovery_events(slurm, job, "host_lost")}
    assert lost == {"node2": "its node is down (Slurm)", "node3": "missed heartbeats"}, lost
    assert {e["host"] for e in commits(events, size=1)} == {"node1"}


def status(slurm: SlurmCluster, job: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`elasticctl status` from the login node, as the job's output says to run it (its latest run's control plane)."""
    control, keys = re.findall(r"elasticctl status --control (\S+) --keys (\S+)", slurm.output(job))[-1]
    argv = [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "status", "--control", control]
    return subprocess.run([*argv, "--keys", keys, *flags], cwd=slurm.user_dir, capture_output=True, text=True)


def preempt_and_resume(slurm: SlurmCluster, job: str) -> dict[str, Any]:
    """Preempt `job` (USR1 to its batch shell): it checkpoints and is requeued within 30 s, and its rerun resumes with
    no committed step lost; the rerun's first `enter` event."""
    signalled = time.time()
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    wait_for(lambda: "requeued (exit" in slurm.output(job), 60, "the driver to checkpoint and ask for a requeue")
    wait_for(lambda: slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), 30, "the requeue")
    requeued = time.time()
    assert requeued - signalled < 30
    resumed = wait_for(
        lambda: [e for e in slurm.events("log") if e["event"] == "enter" and e["time"] > requeued],
        120,
        "the rerun to resume",
    )[0]
    before = [e["batch"] for e in commits(slurm.events("log")) if e["time"] < resumed["time"]]
    assert resumed["batch"] >= max(before), "a step committed before the preemption was lost"
    return resumed


def test_a_preemption_signal_checkpoints_requeues_without_the_host_given_up_on_and_the_rerun_resumes(
    slurm: SlurmCluster,
) -> None:
    """A 2-node job gives up on its second node (its worker killed, --max-restarts 0: blacklisted), is preempted:
    it checkpoints, is requeued without that node, resumes on the two others with no committed step lost, and the
    rerun's `elasticctl status` says the node excluded, and why, naming no other."""
    job = slurm.submit(*job_args("log", 400, nodes=2, flags=("--max-restarts", "0")))
    wait_for(lambda: len(commits(slurm.events("log"), size=2)) > 40, 120, "commits at world size 2", interval=0.2)
    batch_host = re.search(r"agents started on (\w+)", slurm.output(job)).group(1)
    workers = json.loads(status(slurm, job, "--json").stdout)["workers"]
    victim = next(w for w in workers if w["host"] != batch_host and w["state"] == "RUNNING")
    killed_at = time.time()
    os.kill(victim["pid"], signal.SIGKILL)
    first_commit_at_size(slurm, 1, killed_at, 60)

    resumed = preempt_and_resume(slurm, job)
    assert f"excluded from the requeued allocation: {victim['host']}" in slurm.output(job)
    assert f"exit {REQUEUE}" in slurm.output(job)
    assert "run 1;" in slurm.output(job)
    rerun_hosts = {e["host"] for e in slurm.events("log") if e["time"] >= resumed["time"]}
    assert victim["host"] not in rerun_hosts, (
        rerun_hosts,
        run_slurm("scontrol", "show", "job", job),
        slurm.output(job),
    )

    shown = wait_for(lambda: (done := status(slurm, job)).returncode == 0 and done.stdout, 30, "the rerun's status")
    excluded = [line.strip() for line in shown.splitlines() if "excluded" in line]
    said = f"excluded from this allocation: {victim['host']} (the job gave up on it before requeue 1: "
    assert len(excluded) == 1 and excluded[0].startswith(said), shown
    innocent = {"node1", "node2", "node3"} - {victim["host"]}
    assert not any(node in excluded[0] for node in innocent), excluded
    as_json = json.loads(status(slurm, job, "--json").stdout)["excluded"]
    assert [(e["host"], e["requeue"]) for e in as_json] == [(victim["host"], 1)]

    assert slurm.wait_ended(job, 180) == "COMPLETED", slurm.output(job)[-3000:]
    done = [e for e in slurm.events("log") if e["event"] == "done"]
    assert done and all(e["total"] == sum(range(400)) for e in done)


def test_a_node_lost_while_the_job_starts_and_a_second_allocation_that_joins_then_leaves(slurm: SlurmCluster) -> None:
    """Early: node2 set DOWN as soon as the agents' steps start; the job starts on node1 without waiting for node2's
    agent. Then a 1-node allocation joins (node3): the job grows to 2, and shrinks back when it is cancelled."""
    job = slurm.submit("-w", "node[1-2]", *job_args("log", 500, nodes=2))
    wait_for(lambda: "agents started" in slurm.output(job), 60, "the agents' steps", interval=0.05)
    subprocess.run(["scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=test"], check=True)
    first_commit_at_size(slurm, 1, 0.0, 120)
    assert "every agent to register" not in slurm.output(job)  # the start did not wait for the lost node's agent

    joined_at = time.time()
    extra = slurm.submit("-N", "1", "--join", job)
    first_commit_at_size(slurm, 2, joined_at, 90)
    assert {e["host"] for e in commits(slurm.events("log"), size=2)} == {"node1", "node3"}
    script = max((slurm.user_dir / ".elastic-slurm" / "submitted").glob("*.sh"), key=lambda p: p.stat().st_mtime)
    assert "#SBATCH --exclude=node1" in script.read_text().splitlines()  # the joined job's node has its agent

    cancelled_at = time.time()
    subprocess.run(["scancel", extra], check=True)
    at_one = first_commit_at_size(slurm, 1, cancelled_at, 60)
    assert at_one - cancelled_at < LOSS_BUDGET, f"{at_one - cancelled_at:.1f}s from the cancel to one node"
    assert slurm.wait_ended(job, 180) == "COMPLETED", slurm.output(job)[-3000:]
    done = [e for e in slurm.events("log") if e["event"] == "done"]
    assert done and all(e["total"] == sum(range(500)) for e in done)


def test_two_jobs_whose_batch_scripts_share_a_host_each_run_their_own_control_plane(slurm: SlurmCluster) -> None:
    """Every node here is 127.0.0.1: the second job's control plane finds the default ports taken by the first's
    and takes the next ones; both jobs train to the end, each with its own job 1. The second is submitted with
    `--wait`, as scripts and CI block on a job: elasticctl returns when the job ends, with its exit code."""
    jobs = {"a": slurm.submit("-w", "node1", *job_args("a", 200, nodes=1))}
    waiting = subprocess.Popen(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "slurm", "-w", "node2", "--wait"]
        + job_args("b", 200, nodes=1),
        cwd=slurm.user_dir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = waiting.communicate(timeout=240)
    finally:
        waiting.kill()
    jobs["b"] = out.split()[3]
    assert waiting.returncode == 0, err + slurm.output(jobs["b"])[-3000:]
    assert slurm.job_state(jobs["b"]) == "COMPLETED", "--wait returned only once the job ended"
    assert f"job {jobs['b']} ended COMPLETED, exit code 0:0: exit 0" in err, err
    for log, job in jobs.items():
        assert slurm.wait_ended(job, 180) == "COMPLETED", slurm.output(job)[-3000:]
        done = [e for e in slurm.events(log) if e["event"] == "done"]
        assert done and all(e["total"] == sum(range(200)) for e in done)
    addresses = {re.search(r"control plane at (\S+):", slurm.output(job)).group(1) for job in jobs.values()}
    assert len(addresses) == 2 and addresses <= {"127.0.0.1", *(f"127.0.0.1:{p}" for p in range(5560, 6550, 10))}


def test_a_users_scancel_writes_the_last_commit_to_the_checkpoint_and_ends_the_job_without_a_requeue(
    slurm: SlurmCluster,
) -> None:
    """SIGTERM, as Slurm sends it for a user's `scancel` or a preemption with its defaults (the steps too, then SIGKILL
    after KillWait, 5 s here): the checkpoint holds every step committed before it, though the periodic checkpoint
    (600 s) never ran; the job ends CANCELLED and is not requeued (the beside-test: USR1 requeues)."""
    job = slurm.submit(*job_args("log", 2000, nodes=2, checkpoint_every=600))
    wait_for(lambda: len(commits(slurm.events("log"))) > 40, 120, "commits", interval=0.2)
    committed = max(e["batch"] for e in commits(slurm.events("log")))
    subprocess.run(["scancel", job], check=True)
    assert slurm.wait_ended(job, 60) == "CANCELLED", slurm.output(job)[-3000:]
    said = wait_for(lambda: re.search(r"stopped at commit (\d+)", slurm.output(job)), 30, "the driver's last line")
    assert int(said.group(1)) >= committed, (committed, slurm.output(job)[-3000:])
    assert "Restarts=0" in run_slurm("scontrol", "show", "job", job), "not requeued"
    assert "requeued" not in slurm.output(job)


def test_joining_a_job_slurm_does_not_have_is_one_line_and_exit_2(slurm: SlurmCluster) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "slurm", "-N", "1", "--join", "999999"],
        cwd=slurm.user_dir,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == "elasticctl: --join 999999: Slurm has no job 999999"
