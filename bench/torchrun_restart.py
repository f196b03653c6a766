"""A worker SIGKILL in a torchrun/DDP job -> every worker training again, torchrun against the elastic agents (issue 22).

    python -m bench.torchrun_restart [--runs 3] [--nproc 2]

The same script (`examples/ddp_train.py`: DDP on gloo, a save every 5 steps, `--step-delay 0.02`) on the same
machine, one host of `--nproc` workers, run three ways in one go:
  torchrun        `python -m torch.distributed.run --nnodes 1 --nproc-per-node N --max-restarts K
                  --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT` (its defaults otherwise: monitor interval
                  0.1 s), the script saving to its own file;
  elastic-file    `elasticctl run --mode torchrun` on one agent of N slots, the same file;
  elastic-memory  the same with `--host-memory` (libworker.checkpoint: the host's snapshot).
Each variant runs `--runs` times; in each run, once the job has saved step 500 (some 15 s of training), a worker (the highest rank) is
SIGKILLed once (torchrun gets `--max-restarts 3`: on this machine its first restart after a kill often fails to
form its gloo group, "connectFullMesh ... Connection refused", and the next one trains; the time counts until
then, as its user waits that long). Measured: seconds from the kill to
the moment every rank of the new round has logged its first step (all workers training again), and the step
they resumed from against the last step saved before the kill (steps lost).

A run whose job does not train again within RECOVERY_LIMIT seconds (or whose torchrun gives up) counts as not
recovered, and the median is over the runs that did.

Printed: one `RESTART variant=V run=I seconds=S resumed_from=R last_saved=L` line per run, then
`RESTART_SUMMARY variant=V median_s=M recovered=N/RUNS` per variant, the memory of each waiting warm interpreter
300 steps after an elastic run's recovery (`WARM_INTERPRETER ... rss_mib= pss_mib=`), and `RESTART_RATIO torchrun/elastic-memory=X
torchrun/elastic-file=Y`.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import cluster
from testing.harness import REPO, free_ports, read_events, wait_for

RECOVERY_LIMIT = 120.0
KILL_AFTER_STEP = 500  # ~15 s into the job's training: a crash strikes a job that has been running a while
SCRIPT = ["examples/ddp_train.py", "--steps", "1000000", "--step-delay", "0.02", "--save-every", "5"]


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == kind]


def measure_kill(log_dir: Path, nproc: int, variant: str, run: int, gave_up: Callable[[], bool] = lambda: False) -> float | None:
    """Once step KILL_AFTER_STEP is saved, SIGKILL the highest rank; the seconds until every rank of the new round
    trained a step."""
    wait_for(lambda: any(e["step"] >= KILL_AFTER_STEP for e in events(log_dir, "saved")), 180, f"{variant}: step {KILL_AFTER_STEP} saved")
    victim = next(e["pid"] for e in events(log_dir, "start") if e["rank"] == nproc - 1)
    last_saved = max(e["step"] for e in events(log_dir, "saved"))
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)

    def all_training() -> float | None:
        firsts: dict[int, float] = {}
        for e in events(log_dir, "step"):
            if e["restart_count"] > 0 and e["time"] > killed_at:
                firsts.setdefault(e["rank"], e["time"])
        return max(firsts.values()) if len(firsts) == nproc else None

    deadline = time.monotonic() + RECOVERY_LIMIT
    while (trained_at := all_training()) is None:
        if gave_up() or time.monotonic() > deadline:
            print(f"RESTART variant={variant} run={run} seconds=none (the job did not train again)", flush=True)
            return None
        time.sleep(0.05)
    resumed = min(e["step"] for e in events(log_dir, "start") if e["restart_count"] > 0)
    print(f"RESTART variant={variant} run={run} seconds={trained_at - killed_at:.3f} resumed_from={resumed} last_saved={last_saved}", flush=True)
    return trained_at - killed_at


def warm_interpreters_memory(workers: set[int]) -> list[tuple[float, float]]:
    """(RSS MiB, PSS MiB) of each waiting warm interpreter (libworker.warm_start) on this machine: not one of
    `workers` (those run a round's script, started warm)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.name) not in workers and b"libworker.warm_start" in (entry / "cmdline").read_bytes():
                rollup = dict(line.split(":", 1) for line in (entry / "smaps_rollup").read_text().splitlines()[1:])
                found.append((int(rollup["Rss"].split()[0]) / 1024, int(rollup["Pss"].split()[0]) / 1024))
        except (OSError, ValueError, KeyError):
            continue
    return found


def kill_processes_naming(text: str) -> None:
    """SIGKILL every process whose command line names `text`: torchrun starts its workers in sessions of their own,
    so they outlive a killed launcher."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def run_torchrun(nproc: int, run: int) -> float | None:
    workdir = Path(tempfile.mkdtemp(prefix="bench-torchrun-"))
    port = free_ports(1)[0]
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", "3",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
               *SCRIPT, "--checkpoint", str(workdir / "ddp.pt"), "--log-dir", str(workdir / "log")]
    with open(workdir / "torchrun.log", "wb") as log:
        launcher = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return measure_kill(workdir / "log", nproc, "torchrun", run, gave_up=lambda: launcher.poll() is not None)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        kill_processes_naming(str(workdir))


def run_elastic(nproc: int, run: int, host_memory: bool) -> float | None:
    variant = "elastic-memory" if host_memory else "elastic-file"
    with cluster() as elastic:
        elastic.start_agent("host-1", nproc)
        saving = ["--host-memory"] if host_memory else ["--checkpoint", str(elastic.workdir / "ddp.pt")]
        elastic.submit("--mode", "torchrun", "--", sys.executable, *SCRIPT, *saving, "--log-dir", str(elastic.workdir / "log"))
        seconds = measure_kill(elastic.workdir / "log", nproc, variant, run)
        log_dir = elastic.workdir / "log"
        wait_for(lambda: any(e["step"] >= KILL_AFTER_STEP + 300 for e in events(log_dir, "saved")), 120, "300 steps after the kill (the next warm interpreters ready)")
        for rss, pss in warm_interpreters_memory({e["pid"] for e in events(log_dir, "start")}):
            print(f"WARM_INTERPRETER variant={variant} run={run} rss_mib={rss:.0f} pss_mib={pss:.0f}", flush=True)
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="Runs of each variant, one kill in each.")
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    medians = {}
    for variant, once in (("torchrun", lambda run: run_torchrun(args.nproc, run)),
                          ("elastic-file", lambda run: run_elastic(args.nproc, run, False)),
                          ("elastic-memory", lambda run: run_elastic(args.nproc, run, True))):
        results = [once(run) for run in range(1, args.runs + 1)]
        recovered = [seconds for seconds in results if seconds is not None]
        medians[variant] = statistics.median(recovered) if recovered else math.inf
        print(f"RESTART_SUMMARY variant={variant} median_s={medians[variant]:.3f} recovered={len(recovered)}/{len(results)}", flush=True)
    print(f"RESTART_RATIO torchrun/elastic-memory={medians['torchrun'] / medians['elastic-memory']:.1f} "
          f"torchrun/elastic-file={medians['torchrun'] / medians['elastic-file']:.1f}", flush=True)


if __name__ == "__main__":
    main()
