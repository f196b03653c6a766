"""The goodput ledger with the faults test_goodput.py does not inject (issue 49): a hang in user code, a lost host
and a scale-up, in sequence in one job on three hosts (a fourth joins for the scale-up). The report's buckets add up
to the job's wall clock as the test measured it; each fault is charged to its cause (`hang`, `lost_host`,
`scale_up`) and its host; the host that did nothing wrong is charged nothing; the hang's detection lasts the hung
timeout the test set, from when the hung rank stopped (the test's clock) to its kill."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

from testing.harness import Cluster, read_events, wait_for
from tests.integration.test_goodput import interruptions, last_commit_before, report
from tests.integration.training import host_row, steps

HOSTS = ("host-1", "host-2", "host-3")
INNOCENT, LOST, HUNG, NEW = "host-1", "host-2", "host-3", "host-4"
STALLS = [sys.executable, "tests/workers/stalls.py"]
# Seconds: the others' wait for the hung rank, and the hang's detecting, within a couple. It also bounds how long
# workers may stay silent after a round's first report: under it, ranks still starting on a loaded machine are hung.
HUNG_TIMEOUT = 10.0
HANG_AT = 20  # steps: well into the first round at full size, at a commit (the others make it, the hung rank not)


def settled(cluster: Cluster, cause: str) -> dict[str, Any] | None:
    """The report once an interruption of `cause` has ended and the job trains again (None: not yet)."""
    ledger = report(cluster)
    done = ledger["bucket"] in ("training", "training_below_size") and interruptions(ledger, cause)
    return ledger if done else None


def full_size_after(log_dir: Path, instant: float, hosts: set[str]) -> bool:
    """Steps at world size 3 after `instant` from each of `hosts`."""
    return hosts <= {e["host"] for e in steps(log_dir) if e["size"] == 3 and e["time"] > instant}


def test_a_hang_a_lost_host_and_a_scale_up_are_each_charged_to_their_cause_and_host_and_no_one_else(
    cluster: Cluster, tmp_path: Path
) -> None:
    log_dir, hang_once = tmp_path / "train", tmp_path / "hung-once"
    for host in HOSTS:
        cluster.start_agent(host, 1, ["--standby", "0"])
    submitted = time.time()
    cluster.submit(
        "--min-np", "2", "--max-np", "3", "--hung-timeout", str(HUNG_TIMEOUT), "--",
        *STALLS, "--steps", "100000", "--step-s", "0.05", "--commit-every", "10", "--log-dir", str(log_dir),
        "--hang-at", str(HANG_AT), "--hang-host", HUNG, "--hang", "lock", "--hang-once", str(hang_once),
    )  # fmt: skip

    # (1) host-3's worker deadlocks in its own code at step HANG_AT; the others wait for it until it is killed at
    # the hung timeout, and its slot restarts in place.
    hung = wait_for(lambda: [e for e in read_events(log_dir) if e["event"] == "hanging"], 120, "host-3 to hang")[0]
    wait_for(lambda: full_size_after(log_dir, hung["time"], set(HOSTS)), 90, "the job back at full size")
    after_hang = wait_for(lambda: settled(cluster, "hang"), 30, "the hang's interruption ended in the ledger")

    # (2) host-2's agent SIGKILLed and never restarted: discovery declares it lost by its missed heartbeats. First a
    # commit of the round after the hang, so that the work the loss rolls back is this round's alone.
    settled_at = time.time()
    wait_for(
        lambda: any(e["event"] == "commit" and e["rank"] == 0 and e["time"] > settled_at for e in read_events(log_dir)),
        30,
        "a commit after the hang",
    )
    killed_at = time.time()
    cluster.processes[f"agent-{LOST}"].send_signal(signal.SIGKILL)
    wait_for(lambda: host_row(cluster, LOST)["state"] == "lost", 10, "host-2 declared lost")
    wait_for(
        lambda: any(e["size"] == 2 and e["time"] > killed_at for e in steps(log_dir)), 60, "the job trains at size 2"
    )
    wait_for(lambda: settled(cluster, "lost_host"), 30, "the lost host's interruption ended in the ledger")

    # (3) a new host while the job trains below --max-np: it scales up to full size.
    joined_at = time.time()
    cluster.start_agent(NEW, 1, ["--standby", "0"])
    wait_for(lambda: full_size_after(log_dir, joined_at, {INNOCENT, HUNG, NEW}), 90, "the job at full size on host-4")
    wait_for(lambda: settled(cluster, "scale_up"), 30, "the scale-up's interruption ended in the ledger")

    asked_at = time.time()
    ledger = report(cluster)
    answered_at = time.time()
    buckets = ledger["buckets"]
    assert abs(sum(buckets.values()) - ledger["wall_s"]) < 0.05, ledger
    # The test's clock starts before elasticctl run did (its interpreter's start) and reads the ledger mid-job.
    assert answered_at - submitted - 5.0 < ledger["wall_s"] <= answered_at - submitted, (asked_at, submitted, ledger)

    hang, *returned = interruptions(ledger, "hang")
    assert hang == interruptions(after_hang, "hang")[0], "a later fault changes nothing of the hang's entry"
    assert len(returned) <= 1 and {e["host"] for e in (hang, *returned)} == {HUNG}, ledger
    assert abs(hang["at"] - hung["time"]) < 1.0, ("the others began waiting when it hung", hung, hang)
    resumed = {e["step"] for e in read_events(log_dir) if e["event"] == "enter" and e["round"] == hung["round"] + 1}
    assert resumed == {HANG_AT} and hang["lost_work"] < 0.5, ("nothing rolled back past the hung step", resumed, hang)
    assert abs(hang["detecting"] - HUNG_TIMEOUT) < 2.0, (HUNG_TIMEOUT, hang)
    events = cluster.call("notifier", "since", {"seq": 0})["events"]
    (killed,) = [body for event, body in events if event == "worker_hung"]
    assert killed["host"] == HUNG and abs(hang["detecting"] - (killed["time"] - hung["time"])) < 1.0, (killed, hang)

    (lost,) = interruptions(ledger, "lost_host")
    assert lost["host"] == LOST and lost["reason"].startswith("host lost"), lost
    assert killed_at - 0.5 < lost["at"] < killed_at + 1.0, ("its last heartbeat, before the kill", killed_at, lost)
    assert 0 < lost["detecting"] < 3.0, lost
    # Its work since the last commit before the kill is lost (the fault is dated by its last heartbeat, which may
    # come before that commit).
    assert abs(lost["lost_work"] - (killed_at - last_commit_before(log_dir, killed_at))) < 1.0, lost

    (scale_up,) = interruptions(ledger, "scale_up")
    assert scale_up["host"] == NEW and scale_up["lost_work"] == 0.0, "the workers leave for a new host at a commit"
    assert scale_up["at"] > joined_at, (joined_at, scale_up)

    assert ledger["causes"]["crash"] == 0.0, "a hung rank's kill is the hang's, not a crash"
    assert all(ledger["causes"][cause] > 0 for cause in ("hang", "lost_host", "scale_up")), ledger
    assert set(ledger["hosts"]) == {HUNG, LOST, NEW}, "host-1 cost the job nothing"
    assert not [e for e in ledger["interruptions"] if e["host"] == INNOCENT], ledger
    assert buckets["training_below_size"] > 0 and ledger["below_size"]["most_short"] == 1, ledger
