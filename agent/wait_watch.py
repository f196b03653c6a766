"""WaitWatch: what the host's workers wait for, read from their wait records and reported to the registry.

For every worker it starts in a job that finds hangs (`hang_detection`, horovod mode), the agent creates a wait
record and a stack file in shared memory (`ELASTIC_SHM_DIR`, default /dev/shm; slot_processes/wait_record.py),
named after the agent's pid, and removes both when the worker exits (those of an agent killed before it could
are removed by the next agent on the host). Each tick it reads the records and, for a worker that has been busy
(outside any wait) for a while, samples the process's own progress: its CPU time and I/O (/proc/PID/stat,
/proc/PID/io). A worker that uses no CPU and does no I/O is stalled: deadlocked, stuck on a lock, blocked in a
native call. The registry judges hangs and each rank's cost from the `waits` report (services/registry/waits.py):
sent every heartbeat interval, and at once when a worker's wait, busy or stalled time crosses one of the limits the
registry's last reply gave, so a hang is judged within a tick of its limit.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.snapshots import remove_orphans, shm_dir
from agent.workers import STANDBY, Worker
from bus.client import AsyncClient
from bus.envelope import Message
from slot_processes import wait_record

SAMPLE_AFTER = 0.5  # seconds busy before the process's progress is sampled (a training step is shorter)
SAMPLE_EVERY = 0.25
PROGRESS_CPU_SHARE = 0.05  # of one core, over a sample: below it (and without I/O) the process made no progress
PROGRESS_IO_BYTES = 256 * 1024
_FILE_NAME = re.compile(r"^elastic-(?:waits|stack)-(\d+)-")
_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class WatchFiles:
    """A worker's record and stack file, created before it starts."""

    record: str
    stack: str

    def env(self) -> dict[str, str]:
        return {wait_record.RECORD_ENV: self.record, wait_record.STACK_ENV: self.stack}

    def remove(self) -> None:
        for path in (self.record, self.stack):
            Path(path).unlink(missing_ok=True)


@dataclass
class Watched:
    """One worker under watch: its files, its record, and what its progress last looked like."""

    worker: Worker
    files: WatchFiles
    reader: wait_record.RecordReader
    progress: tuple[int, int] | None = None  # CPU ticks and I/O bytes at the last sample
    sampled_at: float = 0.0
    progressed_at: float = 0.0
    reported: dict[str, tuple[float, float]] = field(default_factory=dict)  # quantity: (episode start, value sent)


def process_progress(pid: int) -> tuple[int, int] | None:
    """The process's CPU time (in clock ticks) and the bytes it read and wrote; None when /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        io = Path(f"/proc/{pid}/io").read_text()
    except OSError:
        return None
    after_name = stat.rsplit(")", 1)[1].split()
    cpu_ticks = int(after_name[11]) + int(after_name[12])
    chars = {
        line.split(":")[0]: int(line.split(":")[1]) for line in io.splitlines() if line.startswith(("rchar", "wchar"))
    }
    return cpu_ticks, chars.get("rchar", 0) + chars.get("wchar", 0)


class WaitWatch:
    def __init__(self, host: str, registry: AsyncClient, heartbeat: float, log: Any) -> None:
        self.host, self.registry, self.heartbeat, self.log = host, registry, heartbeat, log
        self.directory = shm_dir()
        self.watched: dict[int, Watched] = {}
        self.limits: tuple[float, ...] = ()
        self._serial = 0
        self._in_flight = False
        remove_orphans(self.directory, _FILE_NAME, "wait_record_orphan_removed", log)

    # -- the workers' files ----------------------------------------------------------------------
    def new_files(self) -> WatchFiles | None:
        """A record and a stack file for a worker about to start; None (and a warning) when they cannot be made."""
        self._serial += 1
        stem = f"{os.getpid()}-{self.host}-{self._serial}"
        files = WatchFiles(str(self.directory / f"elastic-waits-{stem}"), str(self.directory / f"elastic-stack-{stem}"))
        try:
            wait_record.create(files.record)
            Path(files.stack).touch(mode=0o600)
        except OSError as exc:
            files.remove()
            self.log.warning("wait_record_unavailable", reason=str(exc))
            return None
        return files

    def watch(self, worker: Worker, files: WatchFiles) -> None:
        self.watched[worker.pid] = Watched(worker, files, wait_record.RecordReader(files.record))

    def stack_file(self, pid: int) -> str | None:
        watched = self.watched.get(pid)
        return None if watched is None else watched.files.stack

    def forget(self, pid: int) -> None:
        """The worker exited: its files go."""
        watched = self.watched.pop(pid, None)
        if watched is not None:
            watched.reader.close()
            watched.files.remove()

    def close(self) -> None:
        for pid in list(self.watched):
            self.forget(pid)

    # -- reports ---------------------------------------------------------------------------------
    def tick(self) -> None:
        """Every tick: sample the progress of long-busy workers; report at once when a worker crossed a limit."""
        now = time.monotonic()
        rows = self._rows(now)
        if any(self._crossed(watched, row) for watched, row in rows):
            self.report(rows)

    def report(self, rows: list[tuple[Watched, dict[str, Any]]] | None = None) -> None:
        """Send the `waits` report (every heartbeat interval, and when a limit is crossed); one at a time."""
        if self._in_flight:
            return
        rows = self._rows(time.monotonic()) if rows is None else rows
        if not rows:
            return
        for watched, row in rows:
            for quantity in ("waiting_s", "busy_s", "stalled_s"):
                if row[quantity] is not None:
                    watched.reported[quantity] = (row["_episode"], row[quantity])
        self._in_flight = True
        self.registry.send(
            "waits",
            {"host": self.host, "slots": [{k: v for k, v in row.items() if k != "_episode"} for _, row in rows]},
            on_reply=self._on_reply,
            on_timeout=self._on_no_reply,
            timeout=self.heartbeat,
            deadline=self.heartbeat,
        )

    def _on_reply(self, reply: Message) -> None:
        self._in_flight = False
        if reply.error:
            return
        self.limits = tuple(
            float(value)
            for value in (reply.body.get("limit_s"), reply.body.get("upper_s"))
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        )

    def _on_no_reply(self) -> None:
        self._in_flight = False

    def _rows(self, now: float) -> list[tuple[Watched, dict[str, Any]]]:
        """One row per worker of a round (the registry's `waits` format), with the start of the episode it is in."""
        rows = []
        for pid, watched in self.watched.items():
            local_rank = watched.worker.local_rank
            state = watched.reader.read()
            if local_rank == STANDBY or state is None or state.round == 0:
                continue
            waiting = state.waiting_since > 0
            busy = not waiting and state.busy_since > 0
            stalled = self._stalled_for(watched, pid, state.busy_since, now) if busy else None
            rows.append(
                (
                    watched,
                    {
                        "local_rank": local_rank,
                        "pid": pid,
                        "round": state.round,
                        "waiting_s": now - state.waiting_since if waiting else None,
                        "busy_s": now - state.busy_since if busy else None,
                        "stalled_s": stalled,
                        "waits": state.waits,
                        "longest_wait_s": state.longest_wait,
                        "typical_busy_s": state.typical_busy,
                        "waited_total_s": state.waited_total,
                        "_episode": state.waiting_since if waiting else state.busy_since,
                    },
                )
            )
        return rows

    def _stalled_for(self, watched: Watched, pid: int, busy_since: float, now: float) -> float:
        """Seconds since the worker last made progress of its own in this busy stretch (sampled once it has been busy
        SAMPLE_AFTER seconds, every SAMPLE_EVERY)."""
        if watched.progressed_at < busy_since:
            watched.progressed_at, watched.progress = busy_since, None
        if now - busy_since >= SAMPLE_AFTER and now - watched.sampled_at >= SAMPLE_EVERY:
            progress = process_progress(pid)
            if progress is not None:
                if watched.progress is not None and _progressed(watched.progress, progress, now - watched.sampled_at):
                    watched.progressed_at = now
                watched.progress, watched.sampled_at = progress, now
        return now - watched.progressed_at

    def _crossed(self, watched: Watched, row: dict[str, Any]) -> bool:
        """Did a quantity of this row cross a limit since it was last reported (in the same episode)?"""
        for quantity in ("waiting_s", "busy_s", "stalled_s"):
            value = row[quantity]
            if value is None:
                continue
            episode, sent = watched.reported.get(quantity, (None, 0.0))
            before = sent if episode == row["_episode"] else 0.0
            if any(before < limit <= value for limit in self.limits):
                return True
        return False


def _progressed(before: tuple[int, int], after: tuple[int, int], seconds: float) -> bool:
    cpu = (after[0] - before[0]) / _TICKS_PER_SECOND
    return cpu >= PROGRESS_CPU_SHARE * seconds or after[1] - before[1] >= PROGRESS_IO_BYTES
