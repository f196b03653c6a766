"""A flapping host with and without probation (issue 49): a job on 3 hosts x 1 slot whose host-3 worker crashes
`--crash-after` seconds after each time it starts running, measured over a `--duration` window twice in the same
run: with probation (the cooldown doubles with each failure, `--blacklist-cooldown LOW HIGH`, and is forgotten only
after `--probation-clean` seconds without one) and with a flat cooldown (`--blacklist-cooldown LOW LOW`).

    python -m bench.flapping [--duration 120] [--crash-after 20] [--low 5] [--high 80] [--probation-clean 60]

Goodput is the registry's ledger (`elasticctl report JOB --json`): the window's training share (training at full
size, below it, and checkpointing, over the window's wall clock), read at the window's start and end. A crash is a
SIGKILL of host-3's running worker, with `--max-restarts 0`, so every crash blacklists host-3. Intervals are the
production defaults (heartbeat 1 s); every process started here is stopped on the way out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

from bench.common import cluster
from bench.gpu_smoke import running_pid
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.services.registry.ledger import BELOW_SIZE, BUCKETS, CHECKPOINTING, TRAINING
from testing.harness import Cluster, wait_for

HOSTS = ("host-1", "host-2", "host-3")
FLAPPING = "host-3"
JOB = [sys.executable, "examples/train_elastic.py", "--epochs", "1000000", "--step-delay", "0.05"]


def report(c: Cluster) -> dict[str, Any]:
    result = c.elasticctl("report", "1", "--json")
    if result.returncode != 0:
        raise RuntimeError(f"elasticctl report failed: {result.stderr}")
    return json.loads(result.stdout)["goodput"]


def crash_flapping_host(c: Cluster, crash_after: float, until: float) -> int:
    """Until `until`: each time host-3's worker runs, SIGKILL it `crash_after` seconds later; the crashes made."""
    crashes = 0
    while time.time() < until:
        try:
            pid = wait_for(lambda: running_on(c, FLAPPING), max(0.1, until - time.time()), "host-3 running")
        except AssertionError:
            break
        time.sleep(max(0.0, min(crash_after, until - time.time())))
        if time.time() >= until:
            break
        try:
            os.kill(pid, signal.SIGKILL)
            crashes += 1
        except ProcessLookupError:
            pass
        wait_for(lambda: running_on(c, FLAPPING) != pid, 60, "host-3's crashed worker gone")
    return crashes


def running_on(c: Cluster, host: str) -> int | None:
    for worker in c.call("registry", "status")["workers"]:
        if worker["host"] == host and worker["state"] == "RUNNING":
            return int(worker["pid"])
    return None


def one_run(name: str, cooldown: tuple[float, float], clean: float, duration: float, crash_after: float) -> dict:
    with cluster(Timing().as_env()) as c:
        for host in HOSTS:
            c.start_agent(host, 1)
        job = c.submit(
            "--min-np",
            "2",
            "--max-restarts",
            "0",
            "--blacklist-cooldown",
            str(cooldown[0]),
            str(cooldown[1]),
            "--probation-clean",
            str(clean),
            "--",
            *JOB,
            "--log-dir",
            str(c.workdir / "train"),
        )
        for host in HOSTS:
            running_pid(c, host)
        before, start = report(c), time.time()
        crashes = crash_flapping_host(c, crash_after, start + duration)
        time.sleep(max(0.0, start + duration - time.time()))
        after = report(c)
        c.call("registry", "cancel", {"reason": "benchmark done"})
        c.wait_job_end(job, 60)
    seconds = {bucket: after["buckets"][bucket] - before["buckets"][bucket] for bucket in BUCKETS}
    wall = after["wall_s"] - before["wall_s"]
    training = seconds[TRAINING] + seconds[BELOW_SIZE] + seconds[CHECKPOINTING]
    return {
        "run": name,
        "wall_s": wall,
        "training_s": training,
        "goodput": training / wall,
        "crashes": crashes,
        "buckets": {k: round(v, 1) for k, v in seconds.items() if v >= 0.05},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=120.0, help="Seconds of each measured window.")
    parser.add_argument("--crash-after", type=float, default=20.0, help="Seconds host-3's worker runs before it dies.")
    parser.add_argument("--low", type=float, default=5.0, help="The shortest cooldown (both runs).")
    parser.add_argument("--high", type=float, default=80.0, help="The longest cooldown, with probation.")
    parser.add_argument(
        "--probation-clean", type=float, default=60.0, help="Seconds clean before a count is forgotten."
    )
    args = parser.parse_args()
    runs = [
        one_run("probation", (args.low, args.high), args.probation_clean, args.duration, args.crash_after),
        one_run("flat cooldown", (args.low, args.low), args.probation_clean, args.duration, args.crash_after),
    ]
    for run in runs:
        print(
            f"{run['run']:>14}: goodput {run['goodput']:.1%} ({run['training_s']:.1f}s training of "
            f"{run['wall_s']:.1f}s), {run['crashes']} crashes of {FLAPPING}; buckets {run['buckets']}"
        )
    print(f"goodput ratio, probation / flat cooldown: {runs[0]['goodput'] / runs[1]['goodput']:.3f}")


if __name__ == "__main__":
    main()
