"""Elastic jobs on a real 3-node Slurm (scripts/slurm.sh, started and stopped here), against torchrun launched as
pytorch/examples' `sbatch_run.sh` does (one `srun` step of one torchrun per node, c10d rendezvous on the first node).

    python -m bench.slurm [--batches 600] [--only loss|preemption|timelimit|torchrun] [--keep DIR]

--keep DIR keeps each scenario's user directory (the job's output, its workers' event logs, and STATE/JOB/logs: the
services' logs) under DIR/SCENARIO, to see where the seconds went; without it they are removed.

Measured from the outside, as a user sees it (the job's output file and its workers' event logs, polled every
50 ms; each row one run):
  start        a 2-node job: the driver's first line in the output (the allocation has started) -> the first commit
               at 2 nodes
  node lost    scontrol update NodeName=node2 State=DOWN -> the first commit at 1 node
  replacement  a 1-node `elasticctl slurm --join` allocation (node3): its agent started -> the first commit at 2
               nodes again
  preemption   scancel --batch --signal=USR1 -> the driver's "requeued" line (the checkpoint is written by then);
               the requeued run's first line -> its first commit; committed steps lost (resumed batch vs last commit)
  time limit   `-t 3 --signal-before 100`: when Slurm's signal came, the driver's USR1 line -> "requeued", the
               rerun's first line -> its resume, committed steps lost
  torchrun     the same node2 DOWN: Slurm cancels the job's one step and requeues the job (it cannot go on with a
               node less); node2 resumed at once, as a replacement would be: DOWN -> the rerun's first step, and
               the steps lost since the last checkpoint (saved every 5 steps)
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from testing.harness import read_events, wait_for
from testing.slurm_cluster import REPO, SlurmCluster, running_slurm, slurm

TORCHRUN_SCRIPT = """#!/bin/bash
#SBATCH -N 3
#SBATCH --output=torchrun-%j.out
#SBATCH --open-mode=append
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
addr=$(scontrol show node "$head" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p')
echo "torchrun run ${{SLURM_RESTART_COUNT:-0}}"
srun --overlap {torchrun} --nnodes 3 --nproc_per_node 1 --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d \\
    --rdzv_endpoint "$addr:29500" ddp_train.py --checkpoint ddp.pt --steps 2000 --log-dir ddp-log
"""


def seen(probe: Callable[[], Any], timeout: float, what: str) -> float:
    """When `probe` first held (polled every 50 ms)."""
    wait_for(probe, timeout, what, interval=0.05)
    return time.time()


def commit_at(c: SlurmCluster, size: int, after: float, timeout: float = 120) -> float:
    found = wait_for(
        lambda: [
            e["time"] for e in c.events("log") if e["event"] == "commit" and e["size"] == size and e["time"] > after
        ],
        timeout,
        f"a commit at size {size}",
        interval=0.05,
    )
    return min(found)


def elastic_loss_and_replacement(c: SlurmCluster, batches: int) -> dict[str, float]:
    """On 2 nodes, so that node3 is free for the replacement (node2, lost, is blacklisted by the job: a host whose
    workers failed is, as in Horovod, for its cooldown)."""
    job = c.submit("-N", "2", "-w", "node[1-2]", "--", "python", "counter.py", "--batches", str(batches),
                   "--step-delay", "0.05", "--log-dir", "log")  # fmt: skip
    started = seen(lambda: "[elastic slurm] job" in c.output(job), 60, "the driver's first line")
    full = commit_at(c, 2, 0.0)
    down = time.time()
    slurm("scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=bench")
    smaller = commit_at(c, 1, down)
    extra = c.submit("-N", "1", "--join", job)
    agent_up = seen(lambda: "agents started" in c.output(extra), 60, "the joining agents")
    again = commit_at(c, 2, agent_up)
    c.wait_ended(job, 300)
    return {
        "start -> training at 2 nodes": full - started,
        "node DOWN -> training at 1 node": smaller - down,
        "replacement agent -> training at 2 nodes": again - agent_up,
    }


def elastic_preemption(c: SlurmCluster, batches: int) -> dict[str, float]:
    job = c.submit("-N", "3", "--", "python", "counter.py", "--batches", str(batches), "--step-delay", "0.05",
                   "--log-dir", "log")  # fmt: skip
    commit_at(c, 3, 0.0)
    wait_for(lambda: len([e for e in c.events("log") if e["event"] == "commit"]) > 90, 120, "90 commits")
    signalled = time.time()
    slurm("scancel", "--batch", "--signal=USR1", job)
    requeued = seen(lambda: "requeued (exit" in c.output(job), 120, "the requeue")
    rerun = seen(lambda: "run 1;" in c.output(job), 120, "the rerun's first line")
    resumed = wait_for(
        lambda: [e for e in c.events("log") if e["event"] == "enter" and e["batch"] > 0], 120, "the resume"
    )[0]
    first = min(
        wait_for(
            lambda: [e["time"] for e in c.events("log") if e["event"] == "commit" and e["time"] > resumed["time"]],
            120,
            "a commit after the resume",
        )
    )
    full = commit_at(c, 3, resumed["time"])
    last_before = max(e["batch"] for e in c.events("log") if e["event"] == "commit" and e["time"] < resumed["time"])
    c.wait_ended(job, 300)
    return {
        "USR1 -> checkpointed and requeued": requeued - signalled,
        "requeue -> rerun starts (Slurm)": rerun - requeued,
        "rerun start -> training again": first - rerun,
        "rerun start -> training at 3 nodes": full - rerun,
        "committed steps lost": float(max(0, last_before - resumed["batch"])),
    }


def elastic_time_limit(c: SlurmCluster) -> dict[str, float]:
    """`-t 3 --signal-before 100`: Slurm's own USR1 before the limit, then the same checkpoint and requeue."""
    job = c.submit("-N", "3", "-t", "3", "--signal-before", "100", "--", "python", "counter.py", "--batches", "1500",
                   "--step-delay", "0.05", "--log-dir", "log")  # fmt: skip
    started = seen(lambda: "[elastic slurm] job" in c.output(job), 60, "the driver's first line")
    signalled = seen(lambda: "USR1:" in c.output(job), 210, "Slurm's signal before the limit")
    requeued = seen(lambda: "requeued (exit" in c.output(job), 120, "the requeue")
    rerun = seen(lambda: "run 1;" in c.output(job), 120, "the rerun's first line")
    resumed = wait_for(
        lambda: [e for e in c.events("log") if e["event"] == "enter" and e["batch"] > 0], 120, "the resume"
    )[0]
    last_before = max(e["batch"] for e in c.events("log") if e["event"] == "commit" and e["time"] < resumed["time"])
    c.wait_ended(job, 300)
    return {
        "time limit: signal came (s before the 180 s limit)": 180 - (signalled - started),
        "time limit: signal -> checkpointed and requeued": requeued - signalled,
        "time limit: rerun start -> resumed": resumed["time"] - rerun,
        "time limit: committed steps lost": float(max(0, last_before - resumed["batch"])),
    }


def torchrun_loss(c: SlurmCluster) -> dict[str, float]:
    (c.user_dir / "ddp_train.py").write_text((REPO / "examples" / "ddp_train.py").read_text())
    script = c.user_dir / "torchrun.sh"
    script.write_text(TORCHRUN_SCRIPT.format(torchrun=Path(REPO / ".venv" / "bin" / "torchrun")))
    job = subprocess.run(["sbatch", "--parsable", str(script)], cwd=c.user_dir, capture_output=True, text=True,
                         check=True).stdout.strip()  # fmt: skip

    def steps() -> list[dict[str, Any]]:
        return [e for e in read_events(c.user_dir / "ddp-log") if e["event"] == "step"]

    wait_for(lambda: len(steps()) > 3 * 30, 180, "torchrun's first 30 steps", interval=0.1)
    down = time.time()
    slurm("scontrol", "update", "NodeName=node2", "State=DOWN", "Reason=bench")
    last_before = max(e["step"] for e in steps())
    time.sleep(1.0)  # the replacement node comes back at once; Slurm must first see node2 DOWN
    slurm("scontrol", "update", "NodeName=node2", "State=RESUME")
    restarted = wait_for(
        lambda: [e for e in read_events(c.user_dir / "ddp-log") if e["event"] == "start" and e["time"] > down],
        240,
        "torchrun's rerun",
        interval=0.1,
    )
    resumed_step, rerun_at = min(e["step"] for e in restarted), min(e["time"] for e in restarted)
    first = wait_for(lambda: [e["time"] for e in steps() if e["time"] > rerun_at], 120, "a step after the rerun")
    slurm("scancel", job)
    return {
        "torchrun: node DOWN -> training again": min(first) - down,
        "torchrun: steps lost": float(max(0, last_before - resumed_step)),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=600)
    parser.add_argument(
        "--only", choices=("loss", "preemption", "timelimit", "torchrun"), default=None, help="One scenario."
    )
    parser.add_argument("--keep", type=Path, default=None, help="Keep the jobs' directories under this one.")
    args = parser.parse_args()
    rows: dict[str, float] = {}
    with running_slurm(), tempfile.TemporaryDirectory(prefix="bench-slurm-") as removed:
        tmp = args.keep or removed
        for name, scenario in (
            ("loss", lambda c: elastic_loss_and_replacement(c, args.batches)),
            ("preemption", lambda c: elastic_preemption(c, args.batches)),
            ("timelimit", elastic_time_limit),
            ("torchrun", torchrun_loss),
        ):
            if args.only not in (None, name):
                continue
            cluster = SlurmCluster(Path(tmp) / name)
            try:
                rows.update(scenario(cluster))
            finally:
                cluster.reset()
    print("\nbench.slurm: a real 3-node Slurm 22.05 on one machine (scripts/slurm.sh)")
    for name, value in rows.items():
        unit = "" if "lost" in name else " s"
        print(f"  {name:<42} {value:8.2f}{unit}")


if __name__ == "__main__":
    main()
