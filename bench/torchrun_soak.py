"""torchrun mode's processes over repeated resets: fds, threads and RSS of the agent, the slots' supervisors, their
seeds and the round's store server stay flat (issue 31).

    python -m bench.torchrun_soak [--resets 12]

One agent of 2 slots, `examples/ddp_train.py --host-memory`, every default (the fork server): the command of rank 1
is SIGKILLed `--resets` times, each time once both commands of the next round have started. Printed: one
`TORCHRUN_SOAK pid=P cmd=C fds=A->B threads=A->B rss_kb=A->B` line per process alive at both samples (after the
first round, after the last), and the processes that came or went between them (none: supervisors, seeds and the
store server live as long as the job).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

from bench.common import cluster
from testing.harness import read_events, wait_for

WATCHED = (
    b"elastic_control_plane.slot_processes.torchrun_slot",
    b"elastic_control_plane.slot_processes.round_store",
    b"elastic_control_plane.agent.main",
)


def sample() -> dict[int, tuple[str, int, int, int]]:
    """(command, fds, threads, RSS KiB) of every watched process on this machine."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            name = next((w.decode() for w in WATCHED if w in cmdline), None)
            if name is None:
                continue
            rss = next(
                int(line.split()[1]) for line in (entry / "status").read_text().splitlines() if line.startswith("VmRSS")
            )
            found[int(entry.name)] = (name, len(os.listdir(entry / "fd")), len(os.listdir(entry / "task")), rss)
        except (OSError, StopIteration):
            continue
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resets", type=int, default=12)
    args = parser.parse_args()
    with cluster() as c:
        c.start_agent("host-1", 2)
        log_dir = c.workdir / "log"
        c.submit(
            "--mode",
            "torchrun",
            "--",
            sys.executable,
            "examples/ddp_train.py",
            "--steps",
            "1000000",
            "--step-delay",
            "0.02",
            "--save-every",
            "5",
            "--host-memory",
            "--log-dir",
            str(log_dir),
        )

        def starts(after_restart: int = -1) -> list[dict[str, Any]]:
            return [e for e in read_events(log_dir) if e["event"] == "start" and e["restart_count"] > after_restart]

        def saved_in(restart: int) -> bool:
            return any(e["event"] == "saved" and e["restart_count"] == restart for e in read_events(log_dir))

        wait_for(lambda: len(starts()) == 2 and saved_in(0), 120, "the first round to train")
        first = sample()
        for _ in range(args.resets):
            current = max(e["restart_count"] for e in starts())
            os.kill(next(e["pid"] for e in starts(current - 1) if e["rank"] == 1), signal.SIGKILL)
            wait_for(lambda: len(starts(current)) == 2 and saved_in(current + 1), 60, "the next round to train")
        last = sample()
    for pid in sorted(set(first) & set(last)):
        (name, fds, threads, rss), (_, fds2, threads2, rss2) = first[pid], last[pid]
        print(
            f"TORCHRUN_SOAK pid={pid} cmd={name} fds={fds}->{fds2} threads={threads}->{threads2} rss_kb={rss}->{rss2}",
            flush=True,
        )
    print(
        f"TORCHRUN_SOAK gone={sorted(set(first) - set(last))} new={sorted(set(last) - set(first))} "
        f"resets={args.resets}",
        flush=True,
    )


if __name__ == "__main__":
    main()
