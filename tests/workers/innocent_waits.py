"""Legitimate waits outside any collective, as users' training code makes them (tests/workers/stalls.py runs them):
each keeps its rank away from the next all-reduce for a while without being hung.

    sleep           time.sleep: polling for a file another job writes, rate limiting
    child-computes  subprocess.run of a child that computes (data preparation)
    child-waits     subprocess.run of a child that waits (an external tool waiting on a service)
    dataloader      the first batch of a DataLoader(num_workers=1) whose worker computes it
    flock           fcntl.flock on a file another process (not a child of this one) holds locked
    declared-sleep  a sleep inside libworker.elastic.waiting(...), declared for 60 s more than it lasts
"""

from __future__ import annotations

import fcntl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import libworker as elastic

COMPUTE = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass\n"
HOLD_LOCK = (
    "import fcntl, sys, time\n"
    "lock = open(sys.argv[1], 'a')\n"
    "fcntl.flock(lock, fcntl.LOCK_EX)\n"
    "open(sys.argv[1] + '.held', 'w').close()\n"
    "time.sleep(float(sys.argv[2]))\n"
)


class SlowBatches(Dataset[torch.Tensor]):
    """Each item computes for `seconds` in the DataLoader's worker process."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> torch.Tensor:
        end = time.monotonic() + self.seconds
        while time.monotonic() < end:
            pass
        return torch.zeros(4)


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def child_computes(seconds: float) -> None:
    subprocess.run([sys.executable, "-c", COMPUTE, str(seconds)], check=True)


def child_waits(seconds: float) -> None:
    subprocess.run(["sleep", str(seconds)], check=True)


def dataloader(seconds: float) -> None:
    next(iter(DataLoader(SlowBatches(seconds), batch_size=1, num_workers=1)))


def flock(seconds: float) -> None:
    """Another process (started through a shell that exits, so it is nobody's child here) holds the lock."""
    path = Path(tempfile.mkdtemp(prefix="innocent-flock-")) / "lock"
    subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "$0" "$1" "$2" &', HOLD_LOCK, str(path), str(seconds)], check=True
    )
    held = Path(f"{path}.held")
    deadline = time.monotonic() + 30
    while not held.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)


def declared_sleep(seconds: float) -> None:
    with elastic.elastic.waiting("waiting for the next shard", up_to=seconds + 60):
        time.sleep(seconds)


KINDS: dict[str, Callable[[float], None]] = {
    "sleep": sleep,
    "child-computes": child_computes,
    "child-waits": child_waits,
    "dataloader": dataloader,
    "flock": flock,
    "declared-sleep": declared_sleep,
}
