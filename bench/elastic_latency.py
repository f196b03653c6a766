"""Elasticity latency (issue 3): drain -> first step at the new world size; new agent start -> its workers' first step.

    python -m bench.elastic_latency [--repeats 5]

One job on host-1 and host-2 (2 slots each) trains throughout; each repeat
drains host-2 (and undrains it), then starts host-3's agent (and stops it
with SIGTERM), then undrains host-2 and drains it again as soon as the round
that brings it back starts forming (its new workers are still starting): the
drain is folded into that round (issue 11). Intervals are the production
defaults except the driver tick.
"""

from __future__ import annotations

import argparse
import signal
import time

from bench.common import JOB, cluster, first_step_after, report, steady_step_seconds, steps, warm_up
from testing.harness import wait_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    drain, join, pause, folded = [], [], [], []
    with cluster({"ELASTIC_HEARTBEAT": "1.0", "ELASTIC_DISCOVERY_POLL": "1.0"}) as c:
        c.start_agent("host-1", 2)
        c.start_agent("host-2", 2)
        log_dir = c.workdir / "train"
        job = c.submit(
            "--min-np",
            "2",
            "--",
            *JOB,
            "--epochs",
            "1000",
            "--samples",
            "4096",
            "--commit-every",
            "4",
            "--log-dir",
            str(log_dir),
        )
        warm_up(log_dir)
        for _ in range(args.repeats):
            started = time.time()
            c.call("discovery", "drain", {"host": "host-2"})
            drain.append(first_step_after(log_dir, started, size=2)["time"] - started)
            resumed = time.time()
            c.call("discovery", "undrain", {"host": "host-2"})
            first_step_after(log_dir, resumed, size=4)

            started = time.time()
            c.start_agent("host-3", 2)
            joined = first_step_after(log_dir, started, host="host-3")["time"]
            join.append(joined - started)
            first_step_after(log_dir, joined + 1.0)
            rank0 = [e["time"] for e in steps(log_dir) if e["rank"] == 0 and started - 1 < e["time"] <= joined + 1.0]
            pause.append(max(b - a for a, b in zip(rank0, rank0[1:])))
            c.stop("agent-host-3", signal.SIGTERM, timeout=60)
            left = time.time()
            first_step_after(log_dir, left, size=4)
        for _ in range(args.repeats):
            c.call("discovery", "drain", {"host": "host-2"})
            first_step_after(log_dir, time.time(), size=2)
            forming = c.job()["round"]
            c.call("discovery", "undrain", {"host": "host-2"})
            wait_for(lambda: c.job()["round"] > forming, 30, "the round that brings host-2 back to start forming")
            started = time.time()
            c.call("discovery", "drain", {"host": "host-2"})
            folded.append(first_step_after(log_dir, started, size=2)["time"] - started)
            c.call("discovery", "undrain", {"host": "host-2"})
            first_step_after(log_dir, time.time(), size=4)
        baseline = steady_step_seconds(log_dir)
        c.call("registry", "cancel", {"reason": "benchmark done"})
        c.wait_job_end(job, 30)
        wait_for(lambda: steps(log_dir), 1, "steps")
    report(
        "elasticity latency (2 hosts x 2 slots, commit every 4 steps, heartbeat 1 s)",
        {
            "drain -> first step at new size": drain,
            "agent start -> its workers' first step": join,
            "longest training pause while it joins": pause,
            "drain meeting a forming round -> size 2": folded,
        },
        baseline,
    )


if __name__ == "__main__":
    main()
