"""What the collective probe's processes keep per probe: three probe processes (agent/probe_process.py, as three
agents run them) probed together again and again, each one's resident memory, open files and threads after the
warm-up against after every probe since, and the probes' time first and last.

    python -m bench.probe_soak [--probes 200] [--warm-up 20] [--glibc-default]

The processes start as the agent starts them (agent/collective_probe.py, with its PROBE_ENV); `--glibc-default`
starts them without it, the baseline.

Each probe is led by the next process in turn (its store is the one the others join), as discovery asks
(services/discovery/collective_probe.py). A number that grows with the probes is a leak: a host that re-enters a
job for weeks is probed at each entry.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from elastic_control_plane.agent.collective_probe import PROBE_ENV, probe_command

PROCESSES = 3


def resident_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def usage(pid: int) -> dict[str, int]:
    return {
        "rss_kib": resident_kib(pid),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
    }


def read(process: subprocess.Popen[str]) -> dict[str, Any]:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError("a probe process exited")
    return json.loads(line)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--probes", type=int, default=200)
    parser.add_argument("--warm-up", type=int, default=20)
    parser.add_argument("--glibc-default", action="store_true", help="without the agent's PROBE_ENV (the baseline)")
    args = parser.parse_args()
    env = {**os.environ, **({} if args.glibc_default else PROBE_ENV)}
    processes = [
        subprocess.Popen(probe_command("127.0.0.1"), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for _ in range(PROCESSES)
    ]
    try:
        stores = [read(process)["store"] for process in processes]
        took: list[float] = []
        warm: list[dict[str, int]] = []
        for probe in range(args.probes):
            leader = probe % PROCESSES
            began = time.perf_counter()
            for rank, process in enumerate(processes):
                assert process.stdin is not None
                order = (rank - leader) % PROCESSES  # the leader is rank 0 of its probe
                body = {"id": f"soak-{probe}", "rank": order, "size": PROCESSES, "store": stores[leader]}
                process.stdin.write(json.dumps(body) + "\n")
                process.stdin.flush()
            results = [read(process) for process in processes]
            took.append(time.perf_counter() - began)
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                raise RuntimeError(f"probe {probe} failed: {errors[0]}")
            stores = [r["store"] for r in results]
            if probe + 1 == args.warm_up:
                warm = [usage(process.pid) for process in processes]
        last = [usage(process.pid) for process in processes]
        later = args.probes - args.warm_up
        for index, (before, after) in enumerate(zip(warm, last, strict=True)):
            growth = {key: after[key] - before[key] for key in before}
            per_probe = (after["rss_kib"] - before["rss_kib"]) / later
            print(
                f"PROCESS {index} after_warm_up {before} after_{args.probes} {after} growth {growth} "
                f"rss_kib_per_probe {per_probe:.2f}"
            )
        first, final = took[: args.warm_up], took[-args.warm_up :]
        print(
            f"PROBE_S first_{args.warm_up} median {statistics.median(first):.3f} last_{args.warm_up} median "
            f"{statistics.median(final):.3f} ratio {statistics.median(final) / statistics.median(first):.2f}"
        )
    finally:
        for process in processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


if __name__ == "__main__":
    main()
