"""The goodput ledger with a real job (issue 49): a worker crash, a registry SIGKILL and restart, and a drain in one
short job on three hosts. The report's buckets add up to the job's wall clock as the test measured it; the crash is
charged to `crash` and its host, the drain to `drain` and its host, the innocent host nothing; the crash's lost work
is the training since the last commit the workers logged before the kill; the ledger survives the registry's
restart; `elasticctl status`, `report` and the job's final line show it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from elastic_control_plane.services.registry.ledger import SAVE_EVERY_S
from testing.harness import Cluster, read_events, wait_for, worker_pid
from tests.integration.training import JOB, steps, wait_for_size

HOSTS = ("host-1", "host-2", "host-3")
COMMIT_EVERY = 40  # steps: a commit every second or two, so a crash loses a measurable stretch of work


def report(cluster: Cluster) -> dict[str, Any]:
    result = cluster.elasticctl("report", "1", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["goodput"]


def interruptions(ledger: dict[str, Any], cause: str) -> list[dict[str, Any]]:
    return [entry for entry in ledger["interruptions"] if entry["cause"] == cause]


def last_commit_before(log_dir: Path, instant: float) -> float:
    """When rank 0 logged its last commit before `instant` (its wall clock: the test's own)."""
    return max(
        e["time"] for e in read_events(log_dir) if e["event"] == "commit" and e["rank"] == 0 and e["time"] < instant
    )


def test_the_ledger_adds_up_to_the_wall_clock_and_charges_each_interruption_to_its_cause_and_host(
    cluster: Cluster, tmp_path: Path
) -> None:
    for host in HOSTS:
        cluster.start_agent(host, 1, ["--standby", "0"])
    log_dir = tmp_path / "train"
    submitted = time.time()
    run = cluster.submit(
        "--min-np", "2", "--max-np", "3", "--", *JOB, "--epochs", "20", "--step-delay", "0.02",
        "--commit-every", str(COMMIT_EVERY), "--log-dir", str(log_dir),
    )  # fmt: skip
    wait_for_size(log_dir, 3)
    wait_for(lambda: report(cluster)["commits_seen"], 30, "the agents to report the job's commits")
    assert "goodput" in cluster.status()["job"]["goodput"]["headline"]

    # A crash on host-3, long enough after a commit that the work since is measurable.
    wait_for(lambda: sum(e["event"] == "commit" and e["rank"] == 0 for e in read_events(log_dir)) >= 2, 60, "commits")
    victim = worker_pid(cluster, "host-3", 0)
    time.sleep(0.5)  # into the stretch after a commit: the work the crash rolls back (the subject, not a settle)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    lost_measured = killed_at - last_commit_before(log_dir, killed_at)
    wait_for(
        lambda: any(e["size"] == 3 and e["pid"] != victim and e["time"] > killed_at for e in steps(log_dir)),
        60,
        "the job back at full size after the crash",
    )
    # The crash's interruption closed (the job training again, to the ledger too): its entry no longer changes.
    before = wait_for(
        lambda: (
            (ledger := report(cluster))["bucket"] in ("training", "training_below_size")
            and interruptions(ledger, "crash")
            and ledger
        ),
        20,
        "the crash in the ledger, ended",
    )
    # Its re-forming may still move to when the hosts report the round's state synced (a heartbeat later), and the
    # ledger is saved every SAVE_EVERY_S: the entry is final, and saved as it is, once it stayed the same longer.
    seen = [interruptions(before, "crash")]
    polls = int((SAVE_EVERY_S + 1.5) / 0.5)

    def settled_entry() -> dict | None:
        ledger = report(cluster)
        seen.append(interruptions(ledger, "crash"))
        return ledger if len(seen) > polls and all(entry == seen[-1] for entry in seen[-polls:]) else None

    before = wait_for(settled_entry, 40, "the crash's entry unchanged and saved", interval=0.5)

    # The registry killed and started again: the ledger carries on from what it saved.
    cluster.processes["registry"].send_signal(signal.SIGKILL)
    cluster.processes["registry"].wait(timeout=10)
    cluster.start_services(services=("registry",))
    after = report(cluster)
    assert after["wall_s"] >= before["wall_s"]
    crashes = interruptions(before, "crash")
    assert interruptions(after, "crash")[: len(crashes)] == crashes, "the crash's entry survives the restart"

    # A drain of host-2: it leaves at a commit; the job trains on below the size asked.
    drained_at = time.time()
    assert cluster.elasticctl("drain", "host-2").returncode == 0
    wait_for_size(log_dir, 2, after=drained_at)
    assert cluster.wait_job_end(run, 240) == 0, cluster.output("elasticctl-run")
    wall_measured = time.time() - submitted

    ledger = report(cluster)
    buckets = ledger["buckets"]
    assert abs(sum(buckets.values()) - ledger["wall_s"]) < 0.01, ledger
    # The test's clock runs from before elasticctl started to after it exited: a little longer than the job's.
    assert ledger["wall_s"] <= wall_measured and ledger["wall_s"] > wall_measured - 5.0, (wall_measured, ledger)
    # The crash, then its slot's return (restarted in place, it rejoins at the survivors' next commit): both its cost.
    crash, *returned = interruptions(ledger, "crash")
    assert crash["reason"] == "exited with code -9; restarting in place" and len(returned) <= 1, ledger
    assert {entry["host"] for entry in (crash, *returned)} == {"host-3"}, ledger
    assert crash["detecting"] + crash["reforming"] > 0, crash
    assert abs(crash["lost_work"] - lost_measured) < 1.0, (lost_measured, crash)
    (drain,) = interruptions(ledger, "drain")
    assert drain["host"] == "host-2" and drain["lost_work"] == 0.0, "workers leave a drained host at a commit"
    assert buckets["training_below_size"] > 0 and ledger["below_size"]["most_short"] == 1, ledger
    assert set(ledger["hosts"]) == {"host-2", "host-3"}, "host-1 cost the job nothing"
    charged = sum(ledger["causes"].values())
    assert (
        abs(charged - sum(buckets[b] for b in ("detecting", "reforming", "waiting_for_hosts", "paused", "lost_work")))
        < 0.05
    )
    assert ledger["causes"]["crash"] >= crash["lost_work"] and ledger["causes"]["drain"] > 0, ledger
    out = cluster.output("elasticctl-run")
    assert "goodput" in out.splitlines()[-1] and "most lost to" in out.splitlines()[-1], out
    table = cluster.elasticctl("report", "1").stdout
    assert "where the time went:" in table and "host-3" in table, table
    wrong = cluster.elasticctl("report", "7")
    assert wrong.returncode == 1 and wrong.stderr.strip().count("\n") == 0 and "job 1" in wrong.stderr, wrong.stderr
