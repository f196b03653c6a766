"""The goodput ledger across the restarts issue 49 names and test_goodput*.py do not inject: every worker of a job
killed at once (the job resumes from the hosts' snapshots), and a control-plane failover (the active registry replica
SIGKILLed, a standby takes over). The report's buckets add up to the job's wall clock as the test measured it; the
whole-job restart is charged to its own cause and to no host (every host failed alike), its lost work is the
training since the commit the workers last logged, and it rolled back to the commit the job resumed from; across the
failover the entries from before are kept and the time no registry could act is `paused`, charged to the
interruption it stopped (its cause and host), the host that did nothing charged nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from elastic_control_plane.replication.replica import inflate
from elastic_control_plane.services.registry.etcd_store import bucket_of
from elastic_control_plane.services.registry.job import LEDGER_PART
from testing.control_hosts import PREFIX, ReplicatedCluster, replica_name
from testing.harness import Cluster, read_events, wait_for, worker_pid
from tests.integration.test_goodput import interruptions, last_commit_before, report
from tests.integration.test_replicated_control_plane import TAKEOVER_DEADLINE, etcd, replicated  # noqa: F401 (fixtures)
from tests.integration.training import JOB, host_row, steps, wait_for_size

HOSTS = ("host-1", "host-2", "host-3")
COMMIT_EVERY = 40  # steps: a commit every second or two, so the work a restart rolls back is measurable
# An epoch of 170 steps at 3 ranks: its end (a commit too) never falls within a few steps after half a commit interval
# past a commit, where the test kills every worker (a commit then could lose its log line to the kill).
SAMPLES = 8192
TRAINED = ("training", "training_below_size")


def start(cluster: Cluster, log_dir: Path, epochs: int) -> tuple[subprocess.Popen[bytes], float]:
    """HOSTS with a slot each, and a job of 3 slots exactly on them; when the registry took the job, on the test's
    clock (polled from just after `elasticctl run` started)."""
    for host in HOSTS:
        cluster.start_agent(host, 1, ["--standby", "0"])
    run = cluster.submit(
        "--min-np", "3", "--max-np", "3", "--", *JOB, "--epochs", str(epochs), "--samples", str(SAMPLES),
        "--step-delay", "0.02", "--commit-every", str(COMMIT_EVERY), "--log-dir", str(log_dir),
    )  # fmt: skip
    return run, wait_for(lambda: cluster.job().get("spec") is not None and time.time(), 30, "the job to be submitted")


def ended(cluster: Cluster) -> float:
    """When the registry ended the job, on the test's clock."""
    return wait_for(lambda: cluster.job()["state"] in ("succeeded", "failed") and time.time(), 300, "the job's end")


def settled(cluster: Cluster, cause: str) -> dict[str, Any] | None:
    """The report once an interruption of `cause` has ended and the job trains again (None: not yet)."""
    ledger = report(cluster)
    return ledger if ledger["bucket"] in TRAINED and interruptions(ledger, cause) else None


def commits(log_dir: Path, before: float) -> list[dict[str, Any]]:
    """The commits rank 0 logged before `before`."""
    return [e for e in read_events(log_dir) if e["event"] == "commit" and e["rank"] == 0 and e["time"] < before]


def midway_between_commits(log_dir: Path) -> bool:
    """Rank 0 has logged half a commit interval of steps since its last commit (at least two): a kill now rolls back a
    measurable stretch and cuts off no commit's log line."""
    made = commits(log_dir, float("inf"))
    last_step = max((e["step"] for e in steps(log_dir) if e["rank"] == 0), default=0)
    return len(made) >= 2 and last_step >= made[-1]["step"] + COMMIT_EVERY // 2


def assert_adds_up(ledger: dict[str, Any], low: float, high: float) -> None:
    """The buckets add up to the ledger's wall clock, and that to the test's within 1 % or 1 s: between `low` and
    `high`, what the test measured before and after the report was asked."""
    assert abs(sum(ledger["buckets"].values()) - ledger["wall_s"]) < 0.01, ledger
    within = max(1.0, 0.01 * high)
    assert low - within < ledger["wall_s"] < high + within, (low, high, ledger)
    charged = sum(ledger["causes"].values())
    lost = ("detecting", "reforming", "waiting_for_hosts", "paused", "lost_work")
    assert abs(charged - sum(ledger["buckets"][bucket] for bucket in lost)) < 0.05, ledger


def test_every_worker_killed_at_once_is_a_restart_from_snapshots_charged_to_no_host_and_rolled_back_to_its_commit(
    cluster: Cluster, tmp_path: Path
) -> None:
    log_dir = tmp_path / "train"
    run, began = start(cluster, log_dir, epochs=2)
    wait_for_size(log_dir, 3)
    wait_for(lambda: report(cluster)["commits_seen"], 30, "the agents to report the job's commits")
    victims = [worker_pid(cluster, host, 0) for host in HOSTS]

    def kill_midway() -> float | None:
        """Every worker killed at once as soon as they are midway between commits (not seconds later)."""
        if not midway_between_commits(log_dir):
            return None
        killed_at = time.time()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        return killed_at

    killed_at = wait_for(kill_midway, 60, "half a commit interval of steps after a commit")
    made = commits(log_dir, killed_at)
    lost_measured = killed_at - last_commit_before(log_dir, killed_at)
    back = wait_for(
        lambda: [e for e in steps(log_dir) if e["size"] == 3 and e["pid"] not in victims and e["time"] > killed_at],
        90,
        "the job back at full size after the restart",
    )
    wait_for(lambda: settled(cluster, "restart"), 30, "the restart's interruption ended in the ledger")
    assert cluster.wait_job_end(run, 240) == 0, cluster.output("elasticctl-run")
    measured = ended(cluster) - began

    job = cluster.job()
    history = cluster.status()["history"]
    assert any("every worker failed; resuming from the snapshot" in h["reason"] for h in history), history
    resumed = {e["step"] for e in read_events(log_dir) if e["event"] == "enter" and e["pid"] not in victims}
    assert resumed == {made[-1]["step"]}, ("every rank resumed at the last commit logged before the kill", resumed)

    ledger = report(cluster)
    assert_adds_up(ledger, measured, measured)
    (restart,) = interruptions(ledger, "restart")
    assert restart["host"] == "", restart
    assert restart["rolled_back_to"] == job["resumed_from"] == len(made), (len(made), job, restart)
    assert abs(restart["lost_work"] - lost_measured) < 1.0, (lost_measured, restart)
    stopped_for = back[0]["time"] - killed_at
    interrupted = restart["detecting"] + restart["reforming"] + restart["waiting_for_hosts"] + restart["paused"]
    assert abs(interrupted - stopped_for) < 1.0, ("from the kill to the first step after it", stopped_for, restart)
    assert ledger["causes"]["restart"] >= restart["lost_work"] + interrupted - 0.01, ledger
    assert ledger["causes"]["crash"] == 0.0, "the workers' exits are the restart's, not crashes of their hosts"
    assert ledger["hosts"] == {}, "every host failed alike: none is charged"


def last_saved(cluster: ReplicatedCluster) -> float:
    """When the active registry last saved the ledger (wall-clock seconds, as saved in etcd): a registry that takes
    over knows the job's state up to there, and counts an interruption as paused from there."""
    key = f"{PREFIX}/registry/parts/{bucket_of(LEDGER_PART):02d}".encode()
    client = cluster.etcd.client()
    try:
        kv = client.get(key)
    finally:
        client.close()
    assert kv is not None, "the ledger is saved in etcd"
    return float(json.loads(json.loads(inflate(key, kv.value))[LEDGER_PART])["alive"])


def fail_over_the_registry(cluster: ReplicatedCluster) -> tuple[float, float, float]:
    """SIGKILL the active registry replica: when it was killed, when it had last saved the ledger (read before any
    other replica holds the role, so before any other writes) and when another answered (the test's clock)."""
    holder = cluster.active("registry")
    assert holder is not None
    process = cluster.processes[replica_name("registry", holder)]
    killed_at = time.time()
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=10)
    alive = last_saved(cluster)
    assert cluster.active("registry") == holder, "the killed replica's lease outlives this read"
    wait_for(
        lambda: cluster.active("registry") not in (None, holder) and cluster.call("registry", "ping"),
        TAKEOVER_DEADLINE,
        f"another registry replica to take over from {holder}",
    )
    return killed_at, alive, time.time()


def test_a_registry_failover_keeps_the_ledger_and_charges_its_outage_in_an_interruption_as_paused(
    replicated: ReplicatedCluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    cluster, log_dir = replicated, tmp_path / "train"
    _, began = start(cluster, log_dir, epochs=1000)  # ended by the cluster's close
    wait_for_size(log_dir, 3)
    before = wait_for(lambda: settled(cluster, "start"), 60, "the job's start ended in the ledger")

    # The innocent case: a failover while the job trains costs nothing; training goes on through it.
    fail_over_the_registry(cluster)
    during_training = report(cluster)
    assert during_training["bucket"] in TRAINED and during_training["buckets"]["paused"] == 0.0, during_training
    assert interruptions(during_training, "start") == interruptions(before, "start"), "the entries before are kept"

    # host-3's agent lost: the job waits below --min-np, and the registry fails over while it waits.
    lost_at = time.time()
    cluster.processes["agent-host-3"].send_signal(signal.SIGKILL)
    wait_for(lambda: host_row(cluster, "host-3")["state"] == "lost", 20, "host-3 declared lost")
    wait_for(lambda: report(cluster)["bucket"] == "waiting_for_hosts", 30, "the job to wait for hosts")
    killed_at, alive, took_over_at = fail_over_the_registry(cluster)
    assert killed_at - 5.0 - 1.0 < alive <= killed_at, ("saved every 5 s while in an interruption", alive, killed_at)
    waiting = report(cluster)
    assert waiting["bucket"] == "waiting_for_hosts", "the new registry carries on where the job was"
    assert waiting["wall_s"] >= during_training["wall_s"]

    # host-4 joins: the job trains again at full size.
    joined_at = time.time()
    cluster.start_agent("host-4", 1, ["--standby", "0"])
    wait_for(lambda: any(e["size"] == 3 and e["time"] > joined_at for e in steps(log_dir)), 90, "the job at size 3")
    wait_for(lambda: settled(cluster, "lost_host"), 30, "the lost host's interruption ended in the ledger")
    asked_at = time.time()
    ledger = report(cluster)
    assert_adds_up(ledger, asked_at - began, time.time() - began)

    (lost,) = interruptions(ledger, "lost_host")
    assert lost["host"] == "host-3" and lost_at - 0.5 < lost["at"] < lost_at + 1.0, (lost_at, lost)
    assert abs(lost["paused"] - (took_over_at - alive)) < 1.0, ("paused from its last save", alive, took_over_at, lost)
    assert ledger["buckets"]["paused"] == lost["paused"], "the outage while training paused nothing"
    assert interruptions(ledger, "start") == interruptions(before, "start"), "the entries before the failovers kept"
    assert set(ledger["hosts"]) == {"host-3"}, "host-1, host-2 and host-4 cost the job nothing"
    assert ledger["causes"]["lost_host"] >= lost["paused"] + lost["waiting_for_hosts"] > 0, ledger
