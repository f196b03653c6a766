"""WaitWatch: what the host's workers wait for, read from their wait records and reported to the registry.

For every worker it starts in a job that finds hangs (`hang_detection`, horovod mode), the agent creates a wait
record and a stack file in shared memory (`ELASTIC_SHM_DIR`, default /dev/shm; slot_processes/wait_record.py), named
after the agent's pid, and removes both when the worker exits (those of an agent killed before it could are removed
by the next agent on the host). Each tick it reads the records and, for a worker that has been busy (outside any
wait) for a while, samples the progress of its whole process tree (agent/process_tree.py): the CPU time and I/O of
the worker, its DataLoader workers, its subprocesses and theirs, and, where NVML offers it, whether its kernels kept
a GPU busy (agent/gpu_activity.py). A tree that uses no CPU, does no I/O and runs no kernel is stalled: deadlocked,
stuck on a lock, blocked in a native call, or pausing for good reason (a sleep, a lock another job holds, a child
that waits), which only time tells apart. A worker seen stopped inside a collective's wait (by a signal or a tracer:
/proc says so) waits for nobody: the others wait for it, and its own record says it waits too, so no rank would be
judged; it is reported busy and stalled since it was first seen stopped. A worker inside a wait it declared
(libworker.elastic.waiting) is neither busy nor stalled until the declaration's end; its busy time counts from then.
The registry judges hangs and each rank's cost from the `waits` report (services/registry/waits.py): sent every
heartbeat interval, and at once when a worker's wait, busy or stalled time crosses one of the limits the registry's
last reply gave, so a hang is judged within a tick of its limit. The reply also says for how long the host's workers
may wait past the collective timeout (`excuse_s`: the rank they wait for is under the registry's judgement), which
the agent writes into their records. Each report carries the host's training progress (`commit`: its newest commit,
its age and the seconds the host's snapshot writer spent saving, and the round training last resumed in): the
registry's goodput ledger counts lost work, checkpointing and re-forming from it (services/registry/ledger.py).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable, Iterable
from typing import Any

from elastic_control_plane.agent import process_tree
from elastic_control_plane.agent.gpu_activity import GpuActivity
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.snapshots import remove_orphans, shm_dir
from elastic_control_plane.agent.workers import STANDBY, Watch, WatchFiles, Worker
from elastic_control_plane.bus.client import AsyncClient
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.slot_processes import wait_record
from elastic_control_plane.snapshot.layout import CREATE_PRIVATE

# A tree costs ~4 ms to sample (a worker with 4 DataLoader workers and a child: bench/hangs.py's `tree`), so it is
# sampled only once a worker has been busy longer than a training step, once a second: the limits are 30 s or more.
PROGRESS_CPU_SHARE = 0.05  # of one core, over a sample: below it (and without I/O) the tree made no progress
PROGRESS_IO_BYTES = 256 * 1024
_FILE_NAME = re.compile(r"^elastic-(?:waits|stack)-(\d+)-")


class WaitWatch:
    def __init__(self, host: str, registry: AsyncClient, heartbeat: float, log: Any) -> None:
        self.host, self.registry, self.heartbeat, self.log = host, registry, heartbeat, log
        # The host's training progress, sent with each report (agent/snapshots.py `progress`; the agent sets it).
        self.progress: Callable[[], dict[str, Any]] = dict
        self.directory = shm_dir()
        self.limits: tuple[float, ...] = ()
        self._in_flight = False
        self.gpus = GpuActivity()
        self._gpu_busy: set[int] = set()
        self._gpu_sampled_at = 0.0
        if not process_tree.descendants_readable():
            log.warning("hang_watch_without_descendants", reason="this kernel lists no children in /proc")
        if not self.gpus.available:
            log.info("hang_watch_without_gpu_activity", reason=self.gpus.reason)
        remove_orphans(self.directory, _FILE_NAME, "wait_record_orphan_removed", log)

    # -- the workers' files ----------------------------------------------------------------------
    def new_files(self) -> WatchFiles | None:
        """A record and a stack file for a worker about to start; None (and a warning) when they cannot be made."""
        stem = f"{os.getpid()}-{self.host}-{secrets.token_hex(8)}"  # no name another user could take first
        files = WatchFiles(str(self.directory / f"elastic-waits-{stem}"), str(self.directory / f"elastic-stack-{stem}"))
        try:
            wait_record.create(files.record)
            os.close(os.open(files.stack, CREATE_PRIVATE, 0o600))
        except OSError as exc:
            files.remove()
            self.log.warning("wait_record_unavailable", reason=str(exc))
            return None
        return files

    @staticmethod
    def watch(worker: Worker, files: WatchFiles) -> None:
        """The worker started with `files`: it is watched until it exits (its `Watch` closes with it)."""
        worker.watch = Watch(files, wait_record.RecordReader(files.record))

    # -- reports ---------------------------------------------------------------------------------
    def tick(self, workers: Iterable[Worker]) -> None:
        """Every tick: sample the progress of long-busy workers; report at once when a worker crossed a limit."""
        rows = self._rows(workers, time.monotonic())
        if any(self._crossed(watch, row) for watch, row in rows):
            self._send(rows)

    def report(self, workers: Iterable[Worker]) -> None:
        """Send the `waits` report of the host's workers (every heartbeat interval)."""
        self._send(self._rows(workers, time.monotonic()))

    def _send(self, rows: list[tuple[Watch, dict[str, Any]]]) -> None:
        """One report at a time; the registry's reply may excuse the watches it covered."""
        if self._in_flight or not rows:
            return
        for watch, row in rows:
            for quantity in ("waiting_s", "busy_s", "stalled_s"):
                if row[quantity] is not None:
                    watch.reported[quantity] = (row["_episode"], row[quantity])
        self._in_flight = True
        self.registry.send(
            "waits",
            {
                "host": self.host,
                "slots": [{k: v for k, v in row.items() if k != "_episode"} for _, row in rows],
                "commit": self.progress(),
            },
            on_reply=lambda reply: self._on_reply(reply, [watch for watch, _ in rows]),
            on_timeout=self._on_no_reply,
            timeout=self.heartbeat,
            deadline=self.heartbeat,
        )

    def _on_reply(self, reply: Message, reported: list[Watch]) -> None:
        self._in_flight = False
        if reply.error:
            return
        self.limits = tuple(
            float(value)
            for value in (reply.body.get("limit_s"), reply.body.get("kill_s"), reply.body.get("upper_s"))
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        excuse = reply.body.get("excuse_s")
        if isinstance(excuse, (int, float)) and not isinstance(excuse, bool) and excuse > 0:
            until = time.monotonic() + float(excuse)
            for watch in reported:
                watch.excuse(until)

    def _on_no_reply(self) -> None:
        self._in_flight = False

    def _rows(self, workers: Iterable[Worker], now: float) -> list[tuple[Watch, dict[str, Any]]]:
        """One row per watched worker of a round (the registry's `waits` format), with the start of the episode it is
        in."""
        rows = []
        for worker in workers:
            watch, local_rank, pid = worker.watch, worker.local_rank, worker.pid
            if watch is None or watch.closed or local_rank == STANDBY:
                continue
            state = watch.reader.read()
            if state is None or state.round == 0:
                continue
            waiting = state.waiting_since > 0
            declared = state.declared_until > now
            busy_since = max(state.busy_since, state.declared_until) if state.busy_since > 0 else 0.0
            stopped_since = self._stopped_since(watch, pid, state.waiting_since, now) if waiting else None
            if stopped_since is not None:  # it waits for nobody: the others wait for it, stalled since it stopped
                waiting, declared, busy_since = False, False, stopped_since
            busy = not waiting and not declared and busy_since > 0
            stalled = None
            if stopped_since is not None:
                stalled = now - stopped_since  # its children's progress does not move it
            elif busy:
                stalled = self._stalled_for(watch, pid, busy_since, now)
            rows.append(
                (
                    watch,
                    {
                        "local_rank": local_rank,
                        "pid": pid,
                        "round": state.round,
                        "waiting_s": now - state.waiting_since if waiting else None,
                        "busy_s": now - busy_since if busy else None,
                        "stalled_s": stalled,
                        "declared_s": state.declared_until - now if declared and not waiting else None,
                        "declared": state.declared_reason if declared and not waiting else None,
                        "waits": state.waits,
                        "longest_wait_s": state.longest_wait,
                        "typical_busy_s": state.typical_busy,
                        "waited_total_s": state.waited_total,
                        "stopped": stopped_since is not None,
                        "_episode": state.waiting_since if waiting else busy_since,
                    },
                )
            )
        return rows

    def _stalled_for(self, watch: Watch, pid: int, busy_since: float, now: float) -> float:
        """Seconds since the worker's process tree last made progress in this busy stretch (sampled once it has been
        busy `sample_after` seconds, every `sample_every`: agent/intervals.py)."""
        if watch.progressed_at < busy_since:
            watch.progressed_at, watch.used = busy_since, None
        if now - busy_since >= INTERVALS.sample_after and now - watch.sampled_at >= INTERVALS.sample_every:
            used = process_tree.tree_used(pid)
            if used is not None:
                gpu_busy = any(key[0] in self._gpu_busy_pids(now) for key in used)
                if watch.used is not None and (
                    gpu_busy or progressed(process_tree.progress(watch.used, used), now - watch.sampled_at)
                ):
                    watch.progressed_at = now
                watch.used, watch.sampled_at = used, now
        return now - watch.progressed_at

    @staticmethod
    def _stopped_since(watch: Watch, pid: int, waiting_since: float, now: float) -> float | None:
        """Since when the worker, waiting in a collective since `waiting_since`, has been seen stopped (a signal or a
        tracer: it takes no part in the collective, so every rank waits, and its own record says it waits too);
        None while it runs. Looked at once its wait has lasted `sample_every`, every `sample_every`."""
        if watch.stopped_since is not None and watch.stopped_since < waiting_since:
            watch.stopped_since = None  # seen stopped in an earlier wait
        if now - waiting_since >= INTERVALS.sample_every and now - watch.state_sampled_at >= INTERVALS.sample_every:
            watch.state_sampled_at = now
            if not process_tree.stopped(pid):
                watch.stopped_since = None
            elif watch.stopped_since is None:
                watch.stopped_since = now
        return watch.stopped_since

    def _gpu_busy_pids(self, now: float) -> set[int]:
        """The processes NVML saw running kernels lately (asked at most every `sample_every`, for every worker)."""
        if self.gpus.available and now - self._gpu_sampled_at >= INTERVALS.sample_every:
            self._gpu_busy, self._gpu_sampled_at = self.gpus.busy_pids(), now
        return self._gpu_busy

    def _crossed(self, watch: Watch, row: dict[str, Any]) -> bool:
        """Did a quantity of this row cross a limit since it was last reported (in the same episode)?"""
        for quantity in ("waiting_s", "busy_s", "stalled_s"):
            value = row[quantity]
            if value is None:
                continue
            episode, sent = watch.reported.get(quantity, (None, 0.0))
            before = sent if episode == row["_episode"] else 0.0
            if any(before < limit <= value for limit in self.limits):
                return True
        return False


def progressed(used: process_tree.Progress, seconds: float) -> bool:
    """Did a tree that used `used` over `seconds` make progress: a share of a core, or I/O?"""
    return used.cpu_seconds >= PROGRESS_CPU_SHARE * seconds or used.io_bytes >= PROGRESS_IO_BYTES
