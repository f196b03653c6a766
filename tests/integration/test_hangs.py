"""Hung workers and slow ranks (issue 35), with every default of the job spec: a worker that stops in its own code
without dying is found by how long the others wait for it, gives its stack to the job's output, and is replaced in
place; pauses of every rank and short stalls of one are not hangs; a slow rank is named in `elasticctl status`.

The harness's collective timeout is 20 s: a job that trains again well before it found the hang by the waits."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from testing.harness import Cluster, read_events, wait_for

HOSTS = ("host-1", "host-2", "host-3")
STALLS = [sys.executable, "tests/workers/stalls.py"]
FOUND_WELL_BEFORE_THE_COLLECTIVE_TIMEOUT = 12.0


def start(cluster: Cluster, tmp_path: Path, *script_args: str) -> tuple[subprocess.Popen[bytes], Path]:
    for host in HOSTS:
        cluster.start_agent(host, 1, ["--standby", "0"])
    log_dir = tmp_path / "train"
    job = cluster.submit("--min-np", "2", "--", *STALLS, "--log-dir", str(log_dir), *script_args)
    return job, log_dir


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == kind]


def notifier_events(cluster: Cluster, kind: str) -> list[dict[str, Any]]:
    """The bodies of the notifier's kept events of type `kind`."""
    return [body for event, body in cluster.call("notifier", "since", {"seq": 0})["events"] if event == kind]


def hang_and_recover(cluster: Cluster, tmp_path: Path, how: str) -> tuple[Path, dict[str, Any], str]:
    """Host-3's worker hangs (`how`) at step 40 of 140: the others train again at size 2 soon after, the job ends at
    full size with exit 0, host-3 still in it; the hung step, and host-3's output."""
    job, log_dir = start(
        cluster,
        tmp_path,
        "--steps",
        "140",
        "--hang-at",
        "40",
        "--hang-host",
        "host-3",
        "--hang",
        how,
        "--hang-once",
        str(tmp_path / "hung-once"),
    )
    wait_for(lambda: events(log_dir, "hanging"), 120, "host-3's worker to hang")
    hung = events(log_dir, "hanging")[0]
    wait_for(
        lambda: any(e["size"] == 2 and e["time"] > hung["time"] for e in events(log_dir, "step")),
        60,
        "the survivors training without the hung worker",
    )
    again = min(e["time"] for e in events(log_dir, "step") if e["size"] == 2 and e["time"] > hung["time"])
    assert again - hung["time"] < FOUND_WELL_BEFORE_THE_COLLECTIVE_TIMEOUT, (
        f"the others trained again {again - hung['time']:.1f}s after the hang: not found by their waits"
    )
    assert cluster.wait_job_end(job, 240) == 0, cluster.output("elasticctl-run")
    last = events(log_dir, "step")[-1]
    assert last["size"] == 3 and last["step"] == 140, last
    replacements = {e["pid"] for e in events(log_dir, "step") if e["host"] == "host-3" and e["time"] > again}
    assert replacements and hung["pid"] not in replacements, "host-3's slot trained again, in a new process"
    host3 = next(h for h in cluster.status()["hosts"] if h["host"] == "host-3")
    assert not host3["blacklisted"], host3
    return log_dir, hung, cluster.output("agent-host-3")


def test_a_deadlocked_worker_is_found_its_stack_printed_and_its_slot_replaced_in_place(
    cluster: Cluster, tmp_path: Path
) -> None:
    _, hung, output = hang_and_recover(cluster, tmp_path, "lock")
    stack = [line for line in output.splitlines() if line.startswith("[host-3:0] ")]
    assert any("hung: the others waited" in line and "its stack before it was killed" in line for line in stack), (
        output[-3000:]
    )
    assert any("load_next_batch_deadlocked" in line for line in stack), "the function it hung in, in the output"
    published = notifier_events(cluster, "worker_hung")
    assert len(published) == 1 and published[0]["host"] == "host-3" and published[0]["pid"] == hung["pid"]
    assert "load_next_batch_deadlocked" in published[0]["stack"]
    assert "restarting in place" in published[0]["reason"] or published[0]["reason"].startswith("hung")


def test_a_worker_holding_the_gil_in_a_native_call_is_found_the_same_way(cluster: Cluster, tmp_path: Path) -> None:
    _, _, output = hang_and_recover(cluster, tmp_path, "native")
    assert "wait_for_the_gpu_forever" in output, output[-3000:]


def test_a_worker_that_ignores_the_stack_dump_is_killed_anyway(cluster: Cluster, tmp_path: Path) -> None:
    _, _, output = hang_and_recover(cluster, tmp_path, "deaf")
    assert "did not answer the stack dump" in output, output[-3000:]


def test_pauses_of_every_rank_and_short_stalls_of_one_are_not_hangs(cluster: Cluster, tmp_path: Path) -> None:
    """An evaluation on every rank for 8 s (longer than any limit a 50 ms step calibrates), and one rank's slow data
    for 2 s every 25 steps (under the floor): the job trains through both, with no hang and no reset."""
    job, log_dir = start(
        cluster,
        tmp_path,
        "--steps",
        "120",
        "--pause-every",
        "50",
        "--pause-s",
        "8",
        "--slow-host",
        "host-2",
        "--slow-every",
        "25",
        "--slow-s",
        "2",
    )
    assert cluster.wait_job_end(job, 300) == 0, cluster.output("elasticctl-run")
    assert {e["round"] for e in events(log_dir, "step")} == {1}, "no reset"
    assert not notifier_events(cluster, "kill_worker")
    for host in HOSTS:
        assert "hung" not in cluster.output(f"agent-{host}")


@pytest.mark.parametrize("lag", [0.012])
def test_a_slow_rank_is_named_as_the_top_cost_in_status(cluster: Cluster, tmp_path: Path, lag: float) -> None:
    """host-2's rank sleeps 12 ms longer per 50 ms step (about 20 % slower): `elasticctl status` names it first."""
    job, log_dir = start(cluster, tmp_path, "--steps", "100000", "--lag-host", "host-2", "--lag-s", str(lag))
    wait_for(lambda: events(log_dir, "step"), 120, "training")
    started = time.monotonic()

    def top() -> dict[str, Any] | None:
        ranks = cluster.status()["waits"]["ranks"]
        return ranks[0] if ranks and ranks[0]["host"] == "host-2" else None

    named = wait_for(top, 60, "host-2 named as the slowest rank")
    assert named["lost_s_per_min"] > 3.0, named
    shown = cluster.elasticctl("status")
    assert "host-2" in shown.stdout.split("Slowest ranks", 1)[1].splitlines()[2], shown.stdout
    print(f"named after {time.monotonic() - started:.1f}s: {named}")
    cluster.stop("elasticctl-run", signal.SIGINT, timeout=60)
