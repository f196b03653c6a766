"""A worker's process tree and what it used: the CPU time and I/O of the worker and every descendant (DataLoader
workers, subprocesses, their children), read from /proc for the agent's hang watch (agent/wait_watch.py), and
whether a process is stopped.

Descendants are found through each thread's `/proc/PID/task/TID/children` (Linux's CONFIG_PROC_CHILDREN), so a
sample reads the tree's own files and never scans every process of the machine; a tree is read to MAX_PROCESSES at
most. Usage is kept per process, keyed by (pid, start time), so a reused pid is another process: `progress` counts
what each process of the tree used since the last sample, all of it for a process that appeared since (it ran
after that sample), and the reaped children's time a process's own counters add (`cutime`, `cstime`) once they
exit. A kernel without the children files leaves the worker alone to sample (`descendants_readable` says so).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

MAX_PROCESSES = 256
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")

ProcessKey = tuple[int, int]  # (pid, start time in ticks since boot)


@dataclass(frozen=True)
class Used:
    """What one process used so far: CPU time (clock ticks, its reaped children's included) and bytes read and
    written (any file, pipe or socket)."""

    cpu_ticks: int
    io_bytes: int


@dataclass(frozen=True)
class Progress:
    """What a tree used between two samples."""

    cpu_seconds: float
    io_bytes: int
    processes: int  # in the later sample


def descendants_readable() -> bool:
    """Can this kernel list a process's children (CONFIG_PROC_CHILDREN)?"""
    return Path(f"/proc/{os.getpid()}/task/{os.getpid()}/children").exists()


def children(pid: int) -> list[int]:
    """The process's children, from every one of its threads (a child belongs to the thread that forked it)."""
    found: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for thread in threads:
        try:
            found.extend(int(child) for child in Path(f"/proc/{pid}/task/{thread}/children").read_text().split())
        except (OSError, ValueError):
            continue
    return found


def process_used(pid: int) -> tuple[ProcessKey, Used] | None:
    """The process's key and usage; None when it is gone or /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        io = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return None
    after_name = stat.rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(after_name[index]) for index in (11, 12, 13, 14))
    start = int(after_name[19])
    io_bytes = sum(int(line.split(":")[1]) for line in io.splitlines() if line.startswith(("rchar", "wchar")))
    return (pid, start), Used(utime + stime + cutime + cstime, io_bytes)


def stopped(pid: int) -> bool:
    """Is the process stopped: by a signal (SIGSTOP, SIGTSTP, a frozen job) or by a tracer (a debugger)? A stopped
    process makes no progress whatever it waits for."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def tree_used(root: int) -> dict[ProcessKey, Used] | None:
    """Every process of the tree rooted at `root` (breadth first, MAX_PROCESSES at most) and what it used; None
    when the root is gone."""
    first = process_used(root)
    if first is None:
        return None
    used = dict([first])
    queue = children(root)
    while queue and len(used) < MAX_PROCESSES:
        pid = queue.pop(0)
        sample = process_used(pid)
        if sample is None:
            continue  # it exited between the listing and the read
        used[sample[0]] = sample[1]
        queue.extend(children(pid))
    return used


def progress(before: dict[ProcessKey, Used], after: dict[ProcessKey, Used]) -> Progress:
    """What the tree used from `before` to `after` (two samples of `tree_used`)."""
    ticks = io_bytes = 0
    for key, now in after.items():
        then = before.get(key, Used(0, 0))
        ticks += max(0, now.cpu_ticks - then.cpu_ticks)
        io_bytes += max(0, now.io_bytes - then.io_bytes)
    return Progress(ticks / TICKS_PER_SECOND, io_bytes, len(after))
