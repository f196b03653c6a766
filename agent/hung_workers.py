"""HungWorkers: what the agent does with a worker the registry declared hung (`kill_worker`): its stack, then SIGKILL.

A worker found hung by how long the others waited for it (`dump_stack`) is
asked for every thread's Python stack first (STACK_DUMP_SIGNAL, answered by
faulthandler in C, even while a thread holds the GIL); once the dump has
stopped growing, or after DUMP_GRACE when the worker does not answer, it is
killed. The stack goes to the job's output, each line prefixed like the
worker's own (`[host:slot] `), and with the exit report to the registry, which
publishes it (`worker_hung`). Its exit counts as a crash: the slot restarts in
place (agent/keeper.py), toward `--max-restarts`, and its host stays.
A worker silent past the hung timeout (no dump asked) is killed at once, as a
stop the agent asked for.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.reports import ExitReports
from agent.wait_watch import WaitWatch
from agent.workers import Worker
from slot_processes.wait_record import STACK_DUMP_SIGNAL

DUMP_GRACE = 1.0
STACK_KEPT = 64 * 1024


@dataclass
class Dumping:
    """A hung worker asked for its stack: killed once the dump stops growing, or at `deadline`."""

    worker: Worker
    reason: str
    stack_file: str
    deadline: float
    size: int = -1


class HungWorkers:
    def __init__(self, host: str, workers: dict[int, Worker], watch: WaitWatch, reports: ExitReports, log: Any) -> None:
        self.host, self.workers, self.watch, self.reports, self.log = host, workers, watch, reports, log
        self.dumping: dict[int, Dumping] = {}

    def kill(self, body: dict[str, Any]) -> None:
        """The registry's `kill_worker`, for a worker of this host that still runs."""
        worker = self.workers.get(body.get("local_rank", -1))
        if body.get("host") != self.host or worker is None or body.get("pid") not in (None, worker.pid):
            return
        reason = str(body.get("reason") or "registry declared it hung")
        stack_file = self.watch.stack_file(worker.pid)
        if body.get("dump_stack") is not True or stack_file is None:
            self.log.warning("killing_worker", local_rank=worker.local_rank, pid=worker.pid, reason=reason)
            worker.stop_requested = True
            worker.signal(signal.SIGKILL)
            return
        if worker.pid in self.dumping:
            return
        self.log.warning("dumping_hung_worker", local_rank=worker.local_rank, pid=worker.pid, reason=reason)
        self.dumping[worker.pid] = Dumping(worker, reason, stack_file, time.monotonic() + DUMP_GRACE)
        try:
            os.kill(worker.pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            self.dumping.pop(worker.pid)

    def tick(self) -> None:
        """Kill the hung workers whose dump is complete (it stopped growing) or overdue."""
        now = time.monotonic()
        for pid, dumping in list(self.dumping.items()):
            size = _size(dumping.stack_file)
            if (size <= 0 or size != dumping.size) and now < dumping.deadline:
                dumping.size = size
                continue
            del self.dumping[pid]
            self._kill(dumping, size > 0)

    def exited(self, pid: int) -> None:
        self.dumping.pop(pid, None)

    def _kill(self, dumping: Dumping, answered: bool) -> None:
        worker = dumping.worker
        stack = _read(dumping.stack_file) if answered else ""
        worker.signal(signal.SIGKILL)
        self.log.warning(
            "killed_hung_worker", local_rank=worker.local_rank, pid=worker.pid, stack_lines=stack.count("\n")
        )
        prefix = f"[{self.host}:{worker.local_rank}] "
        if stack:
            lines = [f"{dumping.reason}; its stack before it was killed:", *stack.rstrip("\n").splitlines()]
        else:
            lines = [f"{dumping.reason}; it did not answer the stack dump within {DUMP_GRACE:g}s: killed without it"]
        sys.stderr.write("".join(f"{prefix}{line}\n" for line in lines))
        sys.stderr.flush()
        self.reports.note_hang(worker.pid, dumping.reason, stack)


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _read(path: str) -> str:
    """The dump's last STACK_KEPT bytes (faulthandler writes the current thread, the one that hung, last)."""
    try:
        with Path(path).open("rb") as dump:
            dump.seek(max(0, os.stat(path).st_size - STACK_KEPT))
            return dump.read().decode(errors="replace")
    except OSError:
        return ""
