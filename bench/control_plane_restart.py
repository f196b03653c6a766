"""What the death of a control-plane process costs a training job: kill -9 of one service (or all four), the same
command started again after `--outage` seconds, then a worker SIGKILLed to force a reset.

For each case (and a baseline run with no service killed, in the same process) it prints:
- `back_s`: restart -> the restarted services answer;
- `job_s`: restart -> the registry answers for the same job, running, in the same round;
- `max_gap_s`: the longest pause between two commits of rank 0 from the kill to the worker kill (the job's step
  time when training never stopped);
- `resets_for_outage`: resets between the kill and the worker kill (0 when the outage cost no reset);
- `recovery_s`: worker SIGKILL -> the survivor's first commit in the new round;
- `ratio`: recovery_s / the baseline's.

    python -m bench.control_plane_restart [--outage 2.5] [--cases registry,all-four]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import cluster
from testing.harness import SERVICES, read_events, wait_for, worker_pid

JOB = [sys.executable, "tests/workers/counter.py", "--batches", "100000", "--step-delay", "0.02"]
CASES = {**{name: (name,) for name in SERVICES}, "all-four": SERVICES}


def commits(log_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == "commit"]


def run_case(killed: tuple[str, ...], outage: float) -> dict[str, Any]:
    with cluster() as plane:
        log_dir = plane.workdir / "train"
        for host in ("host-1", "host-2"):
            plane.start_agent(host, 1)
        plane.submit("--min-np", "1", "--", *JOB, "--log-dir", str(log_dir))
        wait_for(lambda: len(commits(log_dir)) >= 100 and plane.job()["state"] == "running", 120, "the job to train")
        before = plane.job()
        killed_at = time.time()
        for name in killed:
            plane.processes[name].send_signal(signal.SIGKILL)
            plane.processes[name].wait(timeout=10)
        time.sleep(outage)
        restarted_at = time.time()
        plane.start_services(services=killed)
        back_s = time.time() - restarted_at
        same = (before["job"], "running", before["round"])
        wait_for(
            lambda: (j := plane.job()) and (j["job"], j["state"], j["round"]) == same,
            60,
            "the registry to answer for the job",
        )
        job_s = time.time() - restarted_at
        wait_for(
            lambda: commits(log_dir)[-1]["time"] > time.time() - 0.5 and time.time() > restarted_at + 3,
            60,
            "steady training",
        )
        resets_for_outage = plane.job()["resets"] - before["resets"]
        victim = worker_pid(plane, "host-2", 0)
        victim_killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        first = wait_for(
            lambda: next(
                (
                    e
                    for e in commits(log_dir)
                    if e["time"] > victim_killed_at and e["host"] == "host-1" and e["round"] > before["round"]
                ),
                None,
            ),
            120,
            "a commit in the new round",
        )
        times = sorted(
            e["time"] for e in commits(log_dir) if e["rank"] == 0 and killed_at - 1 <= e["time"] <= victim_killed_at
        )
        return {
            "back_s": back_s,
            "job_s": job_s,
            "max_gap_s": max(b - a for a, b in zip(times, times[1:])),
            "resets_for_outage": resets_for_outage,
            "recovery_s": first["time"] - victim_killed_at,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outage", type=float, default=2.5, help="Seconds between the kill and the restart.")
    parser.add_argument("--cases", default=",".join(CASES), help=f"Comma-separated, of: {', '.join(CASES)}.")
    args = parser.parse_args()
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    baseline = run_case((), 0.0)
    print(
        f"baseline (nothing killed): recovery_s={baseline['recovery_s']:.2f} max_gap_s={baseline['max_gap_s']:.3f}",
        flush=True,
    )
    for case in args.cases.split(","):
        result = run_case(CASES[case], args.outage)
        print(
            f"{case:>10}: back_s={result['back_s']:.2f} job_s={result['job_s']:.2f} "
            f"max_gap_s={result['max_gap_s']:.3f} "
            f"resets_for_outage={result['resets_for_outage']} recovery_s={result['recovery_s']:.2f} "
            f"ratio={result['recovery_s'] / baseline['recovery_s']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
