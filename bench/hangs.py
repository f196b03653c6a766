"""Hung workers and slow ranks (issue 35): how soon a job trains again after a worker hangs, whether its stack reached
the output, how soon a slow rank is named, what the wait accounting costs, and whether long pauses look like hangs.

    python -m bench.hangs [--only hang,straggler,cost,tree,pauses] [--baseline] [--cost-steps 300]
                          [--pause-minutes 10]

Every run: 3 hosts x 1 slot, the production intervals (heartbeat 1 s, collective timeout 60 s), every default of
the job spec, `tests/workers/stalls.py` (a Horovod-style elastic loop, DistributedOptimizer, commit every 5 steps)
with 50 ms steps:
  hang       host-3's worker deadlocks in its own code at step 100 (a lock it holds). Printed: from its last
             step to the `worker_suspected` event (`suspected_after_s`: the calibrated limit, 30 s at the floor),
             to the survivors' first step in a later round (`others_again_s`), from then to the first step at full
             size again (`full_size_after_s`; 0 when the replacement was ready before the survivors re-formed),
             and whether the function it hung in is in the job's output.
             `--baseline` also runs it with `--no-hang-detection` (what the job did before: the collective
             timeout, then the hung timeout; about three minutes).
  straggler  host-2's rank takes 10 ms longer per step (20 % slower); seconds from the first step until
             `elasticctl status` names it the rank that costs the others most.
  cost       in one job of 2 ranks (bench/accounting_worker.py), two DistributedOptimizer trainers taking turns
             step by step (a 1M-parameter MLP and a small conv net, `--cost-steps` each), one writing its waits to
             the wait record, one not: the median ms per step of each, the ratio on/off, the waits per step, what
             recording one wait costs (timed apart) and so its share of a step.
  tree       what the agent pays to sample a worker's process tree (agent/process_tree.py) beside sampling the
             worker alone (the baseline, what it did before): a worker with a DataLoader of 4 workers and a
             subprocess, each read 2,000 times; µs per sample, and the share of one core the agent spends at one
             sample every `sample_every` (only while a worker has been busy `sample_after` outside every collective,
             so never during ordinary steps).
  pauses     a `--pause-minutes` job in which every rank pauses 60 s every 2,000 steps (an evaluation) and
             host-2's rank 2 s every 100 steps (slow data): hangs declared (expected 0) and rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import cluster, steps
from elastic_control_plane.agent import process_tree
from elastic_control_plane.agent.intervals import INTERVALS
from testing.harness import Cluster, read_events, wait_for

HOSTS = ("host-1", "host-2", "host-3")
STALLS = [sys.executable, "tests/workers/stalls.py", "--step-s", "0.05"]
PRODUCTION = {
    "ELASTIC_HEARTBEAT": "1.0",
    "ELASTIC_DISCOVERY_POLL": "1.0",
    "ELASTIC_DRIVER_TICK": "0.1",
    "ELASTIC_COLLECTIVE_TIMEOUT": "60",
}


def start(c: Cluster, log_dir: Path, *args: str, options: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    for host in HOSTS:
        if f"agent-{host}" not in c.processes:
            c.start_agent(host, 1)
    return c.submit("--min-np", "2", *options, "--", *STALLS, "--log-dir", str(log_dir), *args)


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == kind]


def hang(workdir: Path, detection: bool) -> None:
    with cluster(PRODUCTION) as c:
        log_dir = workdir / f"hang-{detection}"
        options = () if detection else ("--no-hang-detection",)
        job = start(
            c,
            log_dir,
            "--steps",
            "400",
            "--hang-at",
            "100",
            "--hang-host",
            "host-3",
            "--hang-once",
            str(workdir / f"hung-{detection}"),
            options=options,
        )
        wait_for(lambda: events(log_dir, "hanging"), 180, "the hang")
        hung = events(log_dir, "hanging")[0]
        again = wait_for(
            lambda: next((e for e in steps(log_dir) if e["round"] > hung["round"] and e["host"] != "host-3"), None),
            400,
            "the survivors in a round after the hang",
        )
        full = wait_for(
            lambda: (
                next((e for e in steps(log_dir) if e["round"] > hung["round"] and e["size"] == 3), None)
                or job.poll() is not None
            ),
            800,
            "full size again, or the job's end",
        )
        code = job.wait(timeout=600)
        suspected = [
            body["time"]
            for event, body in c.call("notifier", "since", {"seq": 0})["events"]
            if event == "worker_suspected"
        ]
        suspected_after = f"{suspected[0] - hung['time']:.2f}" if suspected else "never"
        full_after = f"{full['time'] - again['time']:.2f}" if isinstance(full, dict) else "never(ended at size 2)"
        output = c.output("agent-host-3")
        print(
            f"HANG detection={'on' if detection else 'off'} suspected_after_s={suspected_after} "
            f"others_again_s={again['time'] - hung['time']:.2f} "
            f"full_size_after_s={full_after} "
            f"stack_in_output={'load_next_batch_deadlocked' in output} exit={code}",
            flush=True,
        )


def straggler(workdir: Path) -> None:
    with cluster(PRODUCTION) as c:
        log_dir = workdir / "straggler"
        job = start(c, log_dir, "--steps", "100000", "--lag-host", "host-2", "--lag-s", "0.01")
        wait_for(lambda: steps(log_dir), 180, "training")
        first = min(e["time"] for e in steps(log_dir))

        def named() -> dict[str, Any] | None:
            ranks = c.status()["waits"]["ranks"]
            return ranks[0] if ranks and ranks[0]["host"] == "host-2" else None

        top = wait_for(named, 120, "host-2 named")
        print(
            f"STRAGGLER named_after_s={time.time() - first:.1f} lost_s_per_min={top['lost_s_per_min']:.2f} "
            f"status={c.status()['waits']['ranks']}",
            flush=True,
        )
        c.stop("elasticctl-run")
        job.wait(timeout=60)


def cost(steps_per_model: int) -> None:
    """bench/accounting_worker.py in one job of 2 ranks: DistributedOptimizer steps with the wait accounting on and
    off, taking turns; the median ms per step of each and the ratio on / off, per model."""
    with cluster() as c:
        c.start_agent("host-1", slots=2)
        out = c.workdir / "accounting.json"
        job = c.submit(
            "--min-np",
            "2",
            "--max-np",
            "2",
            "--",
            sys.executable,
            "-m",
            "bench.accounting_worker",
            "--out",
            str(out),
            "--steps",
            str(steps_per_model),
        )
        if c.wait_job_end(job, 1800) != 0:
            sys.exit(f"the accounting job failed; its output:\n{c.output('agent-host-1')[-4000:]}")
        for row in json.loads(out.read_text()):
            print(
                f"COST model={row['model']} step_on_ms={row['on_ms']:.3f} step_off_ms={row['off_ms']:.3f} "
                f"ratio={row['on_ms'] / row['off_ms']:.4f} waits_per_step={row['waits_per_step']:.1f} "
                f"us_per_wait={row['wait_us']:.2f} "
                f"share_of_step={row['waits_per_step'] * row['wait_us'] / 1000 / row['off_ms']:.5f}",
                flush=True,
            )


TREE = """
import subprocess, sys, time
import torch
from torch.utils.data import DataLoader
loader = iter(DataLoader(torch.zeros(1000, 4), batch_size=1, num_workers=4))
next(loader)
child = subprocess.Popen(["sleep", "600"])
print("ready", flush=True)
time.sleep(600)
"""


def tree(samples: int = 2000) -> None:
    """The cost of sampling a worker's whole tree, against sampling the worker alone (the baseline)."""
    worker = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "ready\n"
        processes = len(process_tree.tree_used(worker.pid) or {})
        timings = {}
        for name, sample in (("alone", process_tree.process_used), ("tree", process_tree.tree_used)):
            began = time.perf_counter()
            for _ in range(samples):
                sample(worker.pid)
            timings[name] = (time.perf_counter() - began) / samples * 1e6
        print(
            f"TREE processes={processes} us_per_sample_alone={timings['alone']:.1f} "
            f"us_per_sample_tree={timings['tree']:.1f} ratio={timings['tree'] / timings['alone']:.2f} "
            f"agent_core_share_while_sampling={timings['tree'] / 1e6 / INTERVALS.sample_every:.5f} "
            f"sampled_after_busy_s={INTERVALS.sample_after}",
            flush=True,
        )
    finally:
        for key in process_tree.tree_used(worker.pid) or {}:
            os.kill(key[0], signal.SIGKILL)
        worker.wait()


def pauses(workdir: Path, minutes: float) -> None:
    with cluster(PRODUCTION) as c:
        log_dir = workdir / "pauses"
        job = start(
            c,
            log_dir,
            "--steps",
            "100000",
            "--pause-every",
            "2000",
            "--pause-s",
            "60",
            "--slow-host",
            "host-2",
            "--slow-every",
            "100",
            "--slow-s",
            "2",
        )
        wait_for(lambda: steps(log_dir), 180, "training")
        time.sleep(minutes * 60)
        status = c.status()
        c.stop("elasticctl-run")
        job.wait(timeout=60)
        notices = c.call("notifier", "since", {"seq": 0})["events"]
        hangs = sum(1 for event, _ in notices if event in ("kill_worker", "worker_hung"))
        suspects = sum(1 for event, _ in notices if event == "worker_suspected")
        all_steps = steps(log_dir)
        print(
            f"PAUSES minutes={minutes:g} steps={max(e['step'] for e in all_steps)} "
            f"evaluations={max(e['step'] for e in all_steps) // 2000} "
            f"rounds={sorted({e['round'] for e in all_steps})} hangs_declared={hangs} suspected={suspects} "
            f"limit_s={status['waits']['limit_s']}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="hang,straggler,cost,tree,pauses")
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--cost-steps", type=int, default=300)
    parser.add_argument("--pause-minutes", type=float, default=10.0)
    args = parser.parse_args()
    chosen = args.only.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="elastic-bench-hangs-"))
    try:
        if "hang" in chosen:
            hang(workdir, True)
            if args.baseline:
                hang(workdir, False)
        if "straggler" in chosen:
            straggler(workdir)
        if "cost" in chosen:
            cost(args.cost_steps)
        if "tree" in chosen:
            tree()
        if "pauses" in chosen:
            pauses(workdir, args.pause_minutes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
