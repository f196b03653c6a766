"""A worker SIGKILL in a torchrun/DDP job -> every worker training again, torchrun against the elastic agents (issues
22, 31): a kill early in the job and one late.

    python -m bench.torchrun_restart [--runs 2] [--nproc 2] [--early 3] [--late 60] [--variants
    torchrun,elastic-file,...]

The same script (`examples/ddp_train.py`: DDP on gloo, a save every 5 steps, `--step-delay 0.02`) on the same
machine, one host of `--nproc` workers, run these ways in one go:
  torchrun             `python -m torch.distributed.run --nnodes 1 --nproc-per-node N --max-restarts 6
                       --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT` (its defaults otherwise: monitor
                       interval 0.1 s), the script saving to its own file;
  elastic-file         `elasticctl run --mode torchrun` on one agent of N slots (its defaults: the fork server), the
                       same file;
  elastic-memory       the same with `--host-memory` (libworker.checkpoint: the host's snapshot);
  elastic-file-spawn   elastic-file with `--no-fork-server`: each command a fresh interpreter (the fallback).
Each variant runs `--runs` times. In each run the highest rank is SIGKILLed `--early` seconds after the job's first
step, and again `--late` seconds after it (torchrun gets `--max-restarts 6`: on this machine a restart of its after a
kill sometimes fails to form its gloo group, "connectFullMesh ... Connection refused", and the next one trains; the
time counts until then, as its user waits that long). Measured per kill: seconds from the kill to the moment every
rank of the new round has logged its first step (all workers training again), and the step they resumed from
against the last step saved before the kill.

A kill whose job does not train again within RECOVERY_LIMIT seconds (or whose torchrun gives up) counts as not
recovered (after an early kill that did not recover, the run's late kill is not made), and the median is over the
kills that did.

Printed: one `RESTART variant=V run=I kill=early|late seconds=S resumed_from=R last_saved=L` line per kill, then
`RESTART_SUMMARY variant=V kill=K median_s=M recovered=N/RUNS` per variant and kill, `RESTART_RATIO kill=K
torchrun/V=X` for each elastic variant, and, after each elastic run's late recovery, what torchrun mode costs per
slot beside the worker itself: `SLOT_OVERHEAD variant=V run=I uss_mib_per_slot=U` (the unique memory, USS, of the
slots' supervisors, their seeds and the round's store server, divided by the slots; `/proc/PID/smaps_rollup`).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
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
SCRIPT = ["examples/ddp_train.py", "--steps", "1000000", "--step-delay", "0.02", "--save-every", "5"]
SLOT_PROCESSES = (
    b"elastic_control_plane.slot_processes.torchrun_slot",
    b"elastic_control_plane.slot_processes.round_store",
)


def events(log_dir: Path, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == kind]


def measure_kill(
    log_dir: Path,
    nproc: int,
    variant: str,
    run: int,
    kill: str,
    after_first_step: float,
    gave_up: Callable[[], bool] = lambda: False,
) -> float | None:
    """`after_first_step` seconds after the job's first step, SIGKILL the highest rank of the current round; the
    seconds until every rank of the next round trained a step."""
    first = wait_for(lambda: next(iter(events(log_dir, "step")), None), 180, f"{variant}: the job's first step")
    wait_for(
        lambda: any(e["time"] >= first["time"] + after_first_step for e in events(log_dir, "step")),
        after_first_step + 120,
        f"{variant}: {after_first_step} s of training",
    )
    current = max(e["restart_count"] for e in events(log_dir, "start"))
    victim = next(
        e["pid"] for e in events(log_dir, "start") if e["rank"] == nproc - 1 and e["restart_count"] == current
    )
    last_saved = max((e["step"] for e in events(log_dir, "saved")), default=0)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)

    def all_training() -> float | None:
        firsts: dict[int, float] = {}
        for e in events(log_dir, "step"):
            if e["restart_count"] > current and e["time"] > killed_at:
                firsts.setdefault(e["rank"], e["time"])
        return max(firsts.values()) if len(firsts) == nproc else None

    deadline = time.monotonic() + RECOVERY_LIMIT
    while (trained_at := all_training()) is None:
        if gave_up() or time.monotonic() > deadline:
            print(
                f"RESTART variant={variant} run={run} kill={kill} seconds=none (the job did not train again)",
                flush=True,
            )
            return None
        time.sleep(0.05)
    resumed = min(e["step"] for e in events(log_dir, "start") if e["restart_count"] > current)
    print(
        f"RESTART variant={variant} run={run} kill={kill} seconds={trained_at - killed_at:.3f} "
        f"resumed_from={resumed} last_saved={last_saved}",
        flush=True,
    )
    return trained_at - killed_at


def slot_overhead_mib(workers: set[int]) -> tuple[float, int]:
    """(USS MiB, processes) of every process on this machine whose command line names a torchrun slot's supervisor
    (its seed shows the same) or the round's store server, the commands (`workers`) left out."""
    total, count = 0.0, 0
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int(entry.name) not in workers
                and any(name in (entry / "cmdline").read_bytes() for name in SLOT_PROCESSES)
            ):
                rollup = dict(line.split(":", 1) for line in (entry / "smaps_rollup").read_text().splitlines()[1:])
                total += (int(rollup["Private_Clean"].split()[0]) + int(rollup["Private_Dirty"].split()[0])) / 1024
                count += 1
        except (OSError, ValueError, KeyError):
            continue
    return total, count


def kill_processes_naming(text: str) -> None:
    """SIGKILL every process whose command line names `text`: torchrun starts its workers in sessions of their own,
    so they outlive a killed launcher."""
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            continue


def both_kills(args: argparse.Namespace, measure: Callable[[str, float], float | None]) -> dict[str, float | None]:
    """The early kill, then the late one, unless the job never trained again after the early one."""
    early = measure("early", args.early)
    return {"early": early, "late": None if early is None else measure("late", args.late)}


def run_torchrun(args: argparse.Namespace, run: int) -> dict[str, float | None]:
    workdir = Path(tempfile.mkdtemp(prefix="bench-torchrun-"))
    port = free_ports(1)[0]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(args.nproc),
        "--max-restarts",
        "6",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        *SCRIPT,
        "--checkpoint",
        str(workdir / "ddp.pt"),
        "--log-dir",
        str(workdir / "log"),
    ]
    with open(workdir / "torchrun.log", "wb") as log:
        launcher = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return both_kills(
            args,
            lambda kill, after: measure_kill(
                workdir / "log", args.nproc, "torchrun", run, kill, after, gave_up=lambda: launcher.poll() is not None
            ),
        )
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        kill_processes_naming(str(workdir))
        shutil.rmtree(workdir, ignore_errors=True)


def run_elastic(args: argparse.Namespace, run: int, variant: str) -> dict[str, float | None]:
    with cluster() as elastic:
        elastic.start_agent("host-1", args.nproc)
        saving = ["--host-memory"] if variant == "elastic-memory" else ["--checkpoint", str(elastic.workdir / "ddp.pt")]
        options = ["--no-fork-server"] if variant.endswith("-spawn") else []
        log_dir = elastic.workdir / "log"
        elastic.submit(
            "--mode", "torchrun", *options, "--", sys.executable, *SCRIPT, *saving, "--log-dir", str(log_dir)
        )
        seconds = both_kills(args, lambda kill, after: measure_kill(log_dir, args.nproc, variant, run, kill, after))
        uss, processes = slot_overhead_mib({e["pid"] for e in events(log_dir, "start")})
        print(
            f"SLOT_OVERHEAD variant={variant} run={run} uss_mib_per_slot={uss / args.nproc:.1f} processes={processes}",
            flush=True,
        )
        return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=2, help="Runs of each variant, two kills in each.")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--early", type=float, default=3.0, help="Seconds after the job's first step of the first kill."
    )
    parser.add_argument(
        "--late", type=float, default=60.0, help="Seconds after the job's first step of the second kill."
    )
    parser.add_argument("--variants", default="torchrun,elastic-file,elastic-memory,elastic-file-spawn")
    args = parser.parse_args()
    variants = args.variants.split(",")
    medians: dict[tuple[str, str], float] = {}
    for variant in variants:
        results = [
            run_torchrun(args, run) if variant == "torchrun" else run_elastic(args, run, variant)
            for run in range(1, args.runs + 1)
        ]
        for kill in ("early", "late"):
            recovered = [r[kill] for r in results if r[kill] is not None]
            medians[variant, kill] = statistics.median(recovered) if recovered else math.inf
            print(
                f"RESTART_SUMMARY variant={variant} kill={kill} median_s={medians[variant, kill]:.3f} "
                f"recovered={len(recovered)}/{len(results)}",
                flush=True,
            )
    if "torchrun" in variants:
        for kill in ("early", "late"):
            print(
                f"RESTART_RATIO kill={kill} "
                + " ".join(
                    f"torchrun/{v}={medians['torchrun', kill] / medians[v, kill]:.1f}"
                    for v in variants
                    if v != "torchrun"
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
