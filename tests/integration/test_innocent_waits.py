"""Ranks that wait in their own code for good reason are never judged hung (issue 43), with every default of the job
spec: a sleep, a child that computes, a child that waits, a DataLoader worker that computes a slow batch, a lock
another process holds, each for 20 s, at the first step of a job, in a rank restarted after a crash, and at step 60;
a child or a DataLoader worker computing for 90 s and a 90 s sleep inside `waiting(...)`; and a rank whose first
batch is slower than the kill limit in every life, killed once and then given longer, never crash-looped.

The harness's collective timeout is 20 s: the others wait past it without a reset, excused while the rank they wait
for is under judgement. The guilty cases, beside these, are in test_hangs.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from testing.harness import Cluster, read_events, wait_for

STALLS = [sys.executable, "tests/workers/stalls.py"]
FIVE_WAITS = ("sleep", "child-computes", "child-waits", "dataloader", "flock")


def start(cluster: Cluster, tmp_path: Path, hosts: int, *script_args: str) -> tuple[subprocess.Popen[bytes], Path]:
    for index in range(1, hosts + 1):
        cluster.start_agent(f"host-{index}", 1, ["--standby", "0"])
    log_dir = tmp_path / "train"
    job = cluster.submit("--min-np", "2", "--", *STALLS, "--log-dir", str(log_dir), *script_args)
    return job, log_dir


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == kind]


def judgements(cluster: Cluster) -> list[tuple[str, dict[str, Any]]]:
    """The notifier's kept events that judged a worker suspect or hung."""
    kept = cluster.call("notifier", "since", {"seq": 0})["events"]
    return [(kind, body) for kind, body in kept if kind in ("worker_suspected", "kill_worker", "worker_hung")]


def assert_nobody_judged(cluster: Cluster) -> None:
    assert judgements(cluster) == []
    for name in cluster.processes:
        if name.startswith("agent-"):
            output = cluster.output(name)
            assert "suspected:" not in output and "hung:" not in output, output[-3000:]


def test_the_five_legitimate_waits_of_20_s_never_kill_at_the_first_step_after_a_crash_or_at_step_60(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Hosts 1-5 each wait 20 s in their own way, together, while host-6 waits for them in the next all-reduce: at the
    first step of the job, at the first step of their ranks restarted after each crashed at step 20, and again after
    step 60."""
    innocent = [f"host-{i}:{at}:{kind}:20" for i, kind in enumerate(FIVE_WAITS, start=1) for at in ("first", "60")]
    crashes = [f"--crash=host-{index}:20" for index in range(1, 6)]
    args = [f"--innocent={spec}" for spec in innocent] + crashes + ["--crash-once-dir", str(tmp_path)]
    job, log_dir = start(cluster, tmp_path, 6, "--steps", "80", *args)
    assert cluster.wait_job_end(job, 300) == 0, cluster.output("elasticctl-run")
    done = events(log_dir, "innocent_wait_done")
    for i, kind in enumerate(FIVE_WAITS, start=1):
        mine = [e for e in done if e["host"] == f"host-{i}"]
        assert {e["kind"] for e in mine} == {kind.replace("-", "_")}, mine
        pids = [e["pid"] for e in mine]  # the first life's first step; the replacement's first step, then step 60
        assert len(pids) == 3 and pids[0] != pids[1] == pids[2], mine
    assert_nobody_judged(cluster)
    steps = events(log_dir, "step")
    assert steps[-1]["step"] == 80 and steps[-1]["size"] == 6


def test_ninety_seconds_of_computing_children_or_a_declared_wait_never_kill(cluster: Cluster, tmp_path: Path) -> None:
    """A child computing for 90 s, a DataLoader worker computing a 90 s batch and a 90 s sleep declared with
    `waiting(...)`, together after step 30, while host-4 waits for them: no hang judged, no reset, and status
    shows the declared wait with its reason."""
    kinds = ("child-computes", "dataloader", "declared-sleep")
    args = [f"--innocent=host-{index}:30:{kind}:90" for index, kind in enumerate(kinds, start=1)]
    job, log_dir = start(cluster, tmp_path, 4, "--steps", "60", *args)

    def declared_shown() -> list[dict[str, Any]]:
        return (cluster.status().get("waits") or {}).get("declared") or []

    (declared,) = wait_for(declared_shown, 120, "the declared wait in status")
    assert (declared["host"], declared["reason"]) == ("host-3", "waiting for the next shard")
    shown = cluster.elasticctl("status").stdout
    assert "declared waits (no hang judged while they last):" in shown and "waiting for the next shard" in shown
    assert cluster.wait_job_end(job, 300) == 0, cluster.output("elasticctl-run")
    assert len(events(log_dir, "innocent_wait_done")) == 3
    assert_nobody_judged(cluster)
    assert {e["round"] for e in events(log_dir, "step")} == {1}, "no reset in 90 s past the collective timeout"


def test_a_rank_whose_first_batch_is_slower_than_the_kill_limit_in_every_life_is_killed_once_never_looped(
    cluster: Cluster, tmp_path: Path
) -> None:
    """host-3's first step in every life sleeps 55 s (a slow first batch from a service): its first life is
    suspected at 30 s and killed at 40 s without progress, with its stack, and its slot's limits double; its next
    life waits its 55 s under the doubled limits (suspected at 60 s, killed at 80 s) and trains to the end."""
    job, log_dir = start(cluster, tmp_path, 3, "--steps", "40", "--innocent=host-3:first:sleep:55")
    assert cluster.wait_job_end(job, 300) == 0, cluster.output("elasticctl-run")
    judged = judgements(cluster)
    assert [kind for kind, _ in judged] == ["worker_suspected", "kill_worker", "worker_hung"], (
        judged,
        cluster.output("agent-host-3")[-4000:],
    )
    assert "its slot's next limits double (killed at 80s)" in judged[1][1]["reason"]
    lives = [e for e in events(log_dir, "innocent_wait") if e["host"] == "host-3"]
    done = [e for e in events(log_dir, "innocent_wait_done") if e["host"] == "host-3"]
    assert len(lives) == 2 and [e["pid"] for e in done] == [lives[1]["pid"]], "killed once, then it waited its 55 s"
    last = events(log_dir, "step")[-1]
    assert (last["step"], last["size"]) == (40, 3)
