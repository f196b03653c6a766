"""Training step time: torch DDP against libworker's DistributedOptimizer (and the old per-parameter allreduce).

    python -m bench.step_time [--ranks 2,4] [--steps 100] [--models mlp-1M,...] [--quick]

For each rank count, one job on one host started through the real system
(services, agent, `elasticctl run`); each rank runs `bench/step_time_worker.py`
on MLPs of about 1M, 2M, 4M and 8M parameters (16, 32, 64 and 128 tensors) and
a small conv net (10 tensors, 3x32x32 input). Per model the three trainers
start from the same parameters, see the same batches, and take turns step by
step in rotating order; the table shows rank 0's median ms per step, the
ratio DDP / ours (goal >= 1.0; 2 ranks must not fall under 0.95), and the
largest parameter difference from DDP after the same steps (a correctness
cross-check). More ranks than cores are oversubscribed: the header says so.
The last line is `STEP_TIME min_ratio_2ranks=... min_ratio_4ranks=...`.
On a shared 2-core machine single steps vary by tens of percent, so a ratio
moves by about +-0.05 from run to run even with the default 100 steps.

`--quick` (a CI smoke run): 2 ranks, the 1M MLP, 6 steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from bench.common import cluster
from testing.harness import Cluster


def run_job(c: Cluster, ranks: int, worker_args: list[str]) -> dict[str, Any]:
    out = c.workdir / f"step_time-{ranks}.json"
    job = c.submit(
        "--min-np",
        str(ranks),
        "--max-np",
        str(ranks),
        "--",
        sys.executable,
        "-m",
        "bench.step_time_worker",
        "--out",
        str(out),
        *worker_args,
    )
    if c.wait_job_end(job, 1800) != 0:
        sys.exit(f"the benchmark job failed; its output:\n{c.output('agent-host-1')[-4000:]}")
    return json.loads(out.read_text())


def print_table(report: dict[str, Any]) -> float:
    """Print one rank count's table; returns its smallest DDP / ours ratio."""
    ranks, cores = report["size"], os.cpu_count()
    load = (
        f"oversubscribed: {ranks} ranks on {cores} cores" if ranks > (cores or 1) else f"{ranks} ranks on {cores} cores"
    )
    print(
        f"\n{ranks} ranks, one host ({load}, {report['threads']} torch thread(s) per rank); median ms per step, rank 0"
    )
    print(
        f"{'model':<8} {'params':>7} {'tensors':>7} {'DDP':>8} {'ours':>8} {'DDP/ours':>8} {'old idiom':>9}   "
        "max |param - DDP's|: ours, old"
    )
    ratios = []
    for row in report["results"]:
        ms = row["ms"]
        ratios.append(ms["ddp"] / ms["ours"])
        print(
            f"{row['model']:<8} {row['parameters'] / 1e6:6.2f}M {row['tensors']:>7} {ms['ddp']:8.2f} {ms['ours']:8.2f} "
            f"{ratios[-1]:8.3f} {ms['old']:9.2f}   {row['diff_ours']:.1e}, {row['diff_old']:.1e}"
        )
    return min(ratios)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="2,4", help="Comma-separated rank counts, one job each.")
    parser.add_argument(
        "--steps", type=int, default=100, help="Timed steps per trainer and model (after 5 warm-up steps)."
    )
    parser.add_argument("--models", help="Comma-separated models (default: all of bench.step_time_worker's).")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: 2 ranks, the 1M MLP, 6 steps.")
    args = parser.parse_args()
    ranks = [2] if args.quick else [int(n) for n in args.ranks.split(",")]
    worker_args = (
        ["--models", "mlp-1M", "--steps", "6", "--warmup", "2"] if args.quick else ["--steps", str(args.steps)]
    )
    if args.models and not args.quick:
        worker_args += ["--models", args.models]
    minima = {}
    with cluster() as c:
        c.start_agent("host-1", slots=max(ranks))
        for n in ranks:
            minima[n] = print_table(run_job(c, n, worker_args))
    print("STEP_TIME " + " ".join(f"min_ratio_{n}ranks={ratio:.3f}" for n, ratio in minima.items()))


if __name__ == "__main__":
    main()
