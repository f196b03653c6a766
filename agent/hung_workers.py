"""HungWorkers: what the agent does with a worker the registry suspects (`worker_suspected`: its stack, and it runs
on) or declared hung (`kill_worker`: its stack, then SIGKILL).

A worker found suspect or hung by how long the others waited for it
(`dump_stack`) is asked for every thread's Python stack (STACK_DUMP_SIGNAL,
answered by faulthandler in C, even while a thread holds the GIL; the signal
does not end the process). Once the dump has stopped growing, or after
`dump_grace` (agent/intervals.py) when the worker does not answer, a suspect's stack is printed and
it goes on (once per suspicion: the registry tells it once per stall); a hung
one is killed. The stack goes to the job's output, each line prefixed like the
worker's own (`[host:slot] `), and with the exit report to the registry, which
publishes it (`worker_hung`). Its exit counts as a crash: the slot restarts in
place (agent/keeper.py), toward `--max-restarts`, and its host stays.
A stopped worker (a signal or a debugger stopped it inside a collective: agent/wait_watch.py) cannot answer
the dump until it is continued; it is not asked, the output says so, and a hung one is killed at once.
A worker silent past the hung timeout (no dump asked) is killed at once, as a
stop the agent asked for.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from elastic_control_plane.agent import process_tree
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.workers import StackDump, Worker
from elastic_control_plane.slot_processes.wait_record import STACK_DUMP_SIGNAL

STACK_KEPT = 64 * 1024


class HungWorkers:
    def __init__(self, host: str, workers: dict[int, Worker], log: Any) -> None:
        """`workers`: the host's workers by slot (the keeper's); a dump under way is kept on its worker."""
        self.host, self.workers, self.log = host, workers, log

    def kill(self, body: dict[str, Any]) -> None:
        """The registry's `kill_worker`, for a worker of this host that still runs."""
        worker = self._named_worker(body)
        if worker is None:
            return
        reason = str(body.get("reason") or "registry declared it hung")
        stack_file = worker.stack_file
        if body.get("dump_stack") is not True or stack_file is None:
            self.log.warning("killing_worker", local_rank=worker.local_rank, pid=worker.pid, reason=reason)
            worker.stop_requested = True
            worker.signal(signal.SIGKILL)
            return
        if not self._stopped(worker, reason, kills=True):
            self._dump(worker, reason, stack_file, kills=True)

    def suspect(self, body: dict[str, Any]) -> None:
        """The registry's `worker_suspected`, for a worker of this host that still runs: its stack, and it goes on."""
        worker = self._named_worker(body)
        stack_file = None if worker is None else worker.stack_file
        if worker is None or stack_file is None:
            return
        reason = str(body.get("reason") or "suspected hung")
        if not self._stopped(worker, reason, kills=False):
            self._dump(worker, reason, stack_file, kills=False)

    def _stopped(self, worker: Worker, reason: str, kills: bool) -> bool:
        """A stopped worker cannot answer the stack dump (the signal waits until it is continued): it is said,
        without asking, and a hung one is killed at once. False when the worker runs."""
        if worker.stack_dump is not None or not process_tree.stopped(worker.pid):
            return False
        then = "killed without it" if kills else "it has none to give until it is continued"
        line = f"{reason}; it is stopped (by a signal or a debugger) and cannot give its stack: {then}"
        event = "killed_stopped_worker" if kills else "suspected_stopped_worker"
        self.log.warning(event, local_rank=worker.local_rank, pid=worker.pid)
        if kills:
            worker.signal(signal.SIGKILL)
            worker.hang = {"hung": reason, "stack": ""}
        self._write(worker, [line])
        return True

    def _named_worker(self, body: dict[str, Any]) -> Worker | None:
        """The running worker an event names (host, local rank and pid), when it is this host's."""
        worker = self.workers.get(body.get("local_rank", -1))
        if body.get("host") != self.host or worker is None or body.get("pid") not in (None, worker.pid):
            return None
        return worker

    def _dump(self, worker: Worker, reason: str, stack_file: str, kills: bool) -> None:
        """Ask the worker for its stack (a kill asked while a suspect's dump is under way makes that dump kill)."""
        under_way = worker.stack_dump
        if under_way is not None:
            if kills:
                under_way.kills, under_way.reason = True, reason
            return
        event = "dumping_hung_worker" if kills else "dumping_suspected_worker"
        self.log.warning(event, local_rank=worker.local_rank, pid=worker.pid, reason=reason)
        start = max(0, _size(stack_file))
        worker.stack_dump = StackDump(reason, time.monotonic() + INTERVALS.dump_grace, kills, start)
        try:
            os.kill(worker.pid, STACK_DUMP_SIGNAL)
        except ProcessLookupError:
            worker.stack_dump = None

    def tick(self) -> None:
        """Show the stacks whose dump is complete (it stopped growing) or overdue, and kill the hung workers (a
        worker that exited meanwhile is gone from the keeper, its dump with it)."""
        now = time.monotonic()
        for worker in list(self.workers.values()):
            dumping, stack_file = worker.stack_dump, worker.stack_file
            if dumping is None or stack_file is None:
                continue
            size = _size(stack_file)
            if (size <= dumping.start or size != dumping.size) and now < dumping.deadline:
                dumping.size = size
                continue
            worker.stack_dump = None
            stack = _read(stack_file, dumping.start) if size > dumping.start else ""
            if dumping.kills:
                self._kill(worker, dumping, stack)
            else:
                self._show(worker, dumping, stack, "suspected_worker_stack", "its stack (it runs on):", "")

    def _kill(self, worker: Worker, dumping: StackDump, stack: str) -> None:
        """Kill the hung worker; its exit report will say why, with its stack."""
        worker.signal(signal.SIGKILL)
        worker.hang = {"hung": dumping.reason, "stack": stack}
        self._show(
            worker, dumping, stack, "killed_hung_worker", "its stack before it was killed:", ": killed without it"
        )

    def _show(
        self, worker: Worker, dumping: StackDump, stack: str, event: str, with_stack: str, without_stack: str
    ) -> None:
        """Log the dump and put it into the job's output, each line prefixed like the worker's own."""
        self.log.warning(event, local_rank=worker.local_rank, pid=worker.pid, stack_lines=stack.count("\n"))
        if stack:
            lines = [f"{dumping.reason}; {with_stack}", *stack.rstrip("\n").splitlines()]
        else:
            lines = [
                f"{dumping.reason}; it did not answer the stack dump within {INTERVALS.dump_grace:g}s{without_stack}"
            ]
        self._write(worker, lines)

    def _write(self, worker: Worker, lines: list[str]) -> None:
        """Lines into the job's output, each prefixed like the worker's own."""
        sys.stderr.write("".join(f"[{self.host}:{worker.local_rank}] {line}\n" for line in lines))
        sys.stderr.flush()


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _read(path: str, start: int) -> str:
    """The dump written from `start`, its last STACK_KEPT bytes (faulthandler writes the current thread, the one that
    hung, last)."""
    try:
        with Path(path).open("rb") as dump:
            dump.seek(max(start, os.stat(path).st_size - STACK_KEPT))
            return dump.read().decode(errors="replace")
    except OSError:
        return ""
