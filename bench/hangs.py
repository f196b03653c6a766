"""Hung workers and slow ranks (issue 35): how soon a job trains again after a worker hangs, whether its stack reached
the output, how soon a slow rank is named, what the wait accounting costs, and whether long pauses look like hangs.

    python -m bench.hangs [--only hang,straggler,cost,pauses] [--baseline] [--cost-rounds 3]
                          [--cost-steps 200] [--pause-minutes 10]

Every run: 3 hosts x 1 slot, the production intervals (heartbeat 1 s, collective timeout 60 s), every default of
the job spec, `tests/workers/stalls.py` (a Horovod-style elastic loop, DistributedOptimizer, commit every 5 steps)
with 50 ms steps:
  hang       host-3's worker deadlocks in its own code at step 100 (a lock it holds). Printed: from its last
             step to the survivors' first step in a later round (`others_again_s`), from then to the first step at
             full size again (`full_size_after_s`; 0 when the replacement was ready before the survivors re-formed),
             and whether the function it hung in is in the job's output.
             `--baseline` also runs it with `--no-hang-detection` (what the job did before: the collective
             timeout, then the hung timeout; about three minutes).
  straggler  host-2's rank takes 10 ms longer per step (20 % slower); seconds from the first step until
             `elasticctl status` names it the rank that costs the others most.
  cost       bench/step_time_worker.py's DistributedOptimizer steps (2 ranks, one host; a 1M-parameter MLP and
             a small conv net, `--cost-steps` timed steps each) in jobs with the accounting on and with
             `--no-hang-detection`, alternated `--cost-rounds` times: the median ms per step and the ratio on/off.
  pauses     a `--pause-minutes` job in which every rank pauses 60 s every 2,000 steps (an evaluation) and
             host-2's rank 2 s every 100 steps (slow data): hangs declared (expected 0) and rounds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import cluster, steps
from bench.step_time import run_job
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
        full_after = f"{full['time'] - again['time']:.2f}" if isinstance(full, dict) else "never(ended at size 2)"
        output = c.output("agent-host-3")
        print(
            f"HANG detection={'on' if detection else 'off'} others_again_s={again['time'] - hung['time']:.2f} "
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


def cost(rounds: int, steps_per_model: int) -> None:
    """bench/step_time_worker.py's "ours" trainer (DistributedOptimizer, 2 ranks) in jobs with the accounting on and
    off, alternated `rounds` times in one cluster: the median ms per step of each, and the ratio on / off."""
    worker_args = ["--models", "mlp-1M,convnet", "--steps", str(steps_per_model)]
    ms: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    with cluster() as c:
        c.start_agent("host-1", slots=2)
        for detection in [True, False] * rounds:
            report = run_job(c, 2, worker_args, () if detection else ("--no-hang-detection",))
            for row in report["results"]:
                ms[detection].setdefault(row["model"], []).append(row["ms"]["ours"])
    for model in ms[True]:
        on, off = statistics.median(ms[True][model]), statistics.median(ms[False][model])
        print(
            f"COST model={model} step_on_ms={on:.3f} step_off_ms={off:.3f} ratio={on / off:.4f} "
            f"runs_on={[round(m, 3) for m in ms[True][model]]} runs_off={[round(m, 3) for m in ms[False][model]]}",
            flush=True,
        )


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
        all_steps = steps(log_dir)
        print(
            f"PAUSES minutes={minutes:g} steps={max(e['step'] for e in all_steps)} "
            f"evaluations={max(e['step'] for e in all_steps) // 2000} "
            f"rounds={sorted({e['round'] for e in all_steps})} hangs_declared={hangs} "
            f"limit_s={status['waits']['limit_s']}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="hang,straggler,cost,pauses")
    parser.add_argument("--baseline", action="store_true")
    parser.add_argument("--cost-rounds", type=int, default=3)
    parser.add_argument("--cost-steps", type=int, default=200)
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
            cost(args.cost_rounds, args.cost_steps)
        if "pauses" in chosen:
            pauses(workdir, args.pause_minutes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
