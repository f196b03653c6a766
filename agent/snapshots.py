"""The agent's part in snapshots: it owns the host's snapshot buffers, reports them, flushes them to disk, removes them;
and the host's training progress its snapshot writer tells (`committed`, `resumed`), for the goodput ledger.

For each job the agent creates two empty buffer files in shared memory
(`ELASTIC_SHM_DIR`, default /dev/shm), named after its own pid and a random
token, new and owner-only (never a file or link someone made first), and hands
their prefix to every worker it starts; they outlive every worker and go when
the job ends or the agent stops. Buffers left by an agent that died without
cleaning up (SIGKILL) are removed by the next agent that starts on the host.

With `--checkpoint-dir`, a background thread copies the newest snapshot there
(snapshot/durable.py) at most every `checkpoint_interval` seconds, one flush at
a time: training never waits for the disk; and once more when the host drains and its workers have left
(`flush_now`), or the job ends while it drains, so a drained job's last commit is on disk.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from elastic_control_plane.agent.metrics import COMMIT_SECONDS
from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.bus.lifetime import alive
from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.snapshot import durable, layout

_BUFFER_NAME = re.compile(r"^elastic-snapshot-(\d+)-.+\.[01]$")


def shm_dir() -> Path:
    return Path(os.environ.get("ELASTIC_SHM_DIR", "/dev/shm"))


PID_MAX = 4_194_304  # Linux's largest pid_max: a larger number names no process


def remove_orphans(directory: Path, name: re.Pattern[str], event: str, log: Any) -> None:
    """Remove this user's files of `directory` whose `name` (its first group: the agent's pid) says an agent that is
    gone made them (it was killed before it could remove them); each is logged as `event`.

    The directory is shared (/dev/shm): a file is ours by its owner before its name. Another user's file, a
    symlink or anything but a plain file is left alone unlooked-at; a name whose pid is out of range, or a file
    that cannot be removed, is skipped and logged (`shared_file_skipped`); none of it stops the agent."""
    for path in directory.glob("elastic-*"):
        try:
            info = path.lstat()
        except OSError:
            continue  # gone meanwhile
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            continue
        match = name.match(path.name)
        if match is None:
            continue
        pid = int(match.group(1))
        if not 0 < pid <= PID_MAX:
            log.warning("shared_file_skipped", path=str(path), reason=f"pid {match.group(1)[:20]} is out of range")
            continue
        if alive(pid):
            continue
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("shared_file_skipped", path=str(path), reason=f"cannot remove it: {exc.strerror}")
            continue
        log.info(event, path=str(path))


class SnapshotKeeper:
    def __init__(self, host: str, log: Any) -> None:
        self.host, self.log = host, log
        self.directory = shm_dir()
        # The agent's pid names whose they are (remove_orphans); the token makes a name nobody can take first.
        self.prefix = str(self.directory / f"elastic-snapshot-{os.getpid()}-{host}-{secrets.token_hex(8)}")
        self.job_key = ""
        self.created = False
        self.checkpoint_dir: Path | None = None
        self.checkpoint_interval = 30.0
        self.last_checkpoint: durable.Checkpoint | None = None
        self.saving_s = 0.0  # seconds this job's snapshot writer on this host spent saving commits (`committed`)
        self.resumed = (0, 0.0)  # the round its workers last resumed training in (`resumed_in`), and when
        self._next_flush_at = 0.0
        self._flushing: Future[durable.Checkpoint | None] | None = None
        self._executor: ThreadPoolExecutor | None = None
        remove_orphans(self.directory, _BUFFER_NAME, "snapshot_orphan_removed", log)

    def start_job(self, plan: JobPlan) -> None:
        """Fresh, empty buffers for a new job (a worker of the previous one can no longer be restored from them)."""
        self.job_key = plan.job_key
        self.checkpoint_dir = Path(plan.spec.checkpoint_dir) if plan.spec.checkpoint_dir else None
        self.checkpoint_interval = plan.spec.checkpoint_interval
        self.last_checkpoint = None
        self.saving_s, self.resumed = 0.0, (0, 0.0)
        self._flushing = None
        try:
            layout.create(self.prefix)
            self.created = True
        except OSError as exc:
            self.created = False
            self.log.error(
                "snapshot_unavailable",
                path=self.prefix,
                reason=exc.strerror,
                effect="this job's commits are not snapshotted on this host",
            )

    def worker_env(self) -> dict[str, str]:
        env = {WorkerEnv.SNAPSHOT: self.prefix, WorkerEnv.JOB_KEY: self.job_key} if self.created else {}
        if self.checkpoint_dir is not None:
            env[WorkerEnv.CHECKPOINT_DIR] = str(self.checkpoint_dir)
        return env

    def end_job(self, flush: bool = False) -> None:
        """The job's buffers go; `flush` (the host drains: a preemption) writes their newest commit to --checkpoint-dir
        first: the job may end (its last worker's exit judged) before the drain's own flush, once the workers left."""
        if flush:
            self.flush_now()
        self.job_key = ""
        self.created = False
        self.checkpoint_dir = None
        layout.remove(self.prefix)

    def newest(self) -> layout.BufferHeader | None:
        header = layout.newest_header(layout.buffer_paths(self.prefix))
        return header if header is not None and header.job == self.job_key else None

    def committed(self, seconds: float) -> None:
        """The host's snapshot writer saved a commit in `seconds`."""
        COMMIT_SECONDS.labels(self.host).observe(seconds)
        self.saving_s += seconds

    def resumed_in(self, round_number: int) -> None:
        """The host's snapshot writer synced round `round_number`'s state: training resumes."""
        self.resumed = (round_number, time.monotonic())

    def progress(self) -> dict[str, Any]:
        """For the registry's goodput ledger (sent with the `waits` report): the newest commit (0: none yet), its age
        on this host's clock (None: none), the seconds the host's writer spent saving commits, and the round training
        last resumed in (0: none yet) with how long ago."""
        header = self.newest()
        age = None if header is None else max(0.0, time.time() - header.written_at)
        resumed_round, resumed_at = self.resumed
        return {
            "commit": 0 if header is None else header.commit,
            "age_s": age,
            "saving_s": self.saving_s,
            "resumed_round": resumed_round,
            "resumed_age_s": max(0.0, time.monotonic() - resumed_at) if resumed_round else None,
        }

    def report(self) -> dict[str, Any]:
        """What the agent tells the control plane: the snapshot's commit, size and time, and the last checkpoint."""
        header = self.newest()
        report: dict[str, Any] = {}
        if header is not None:
            report["snapshot"] = {
                "commit": header.commit,
                "bytes": header.payload_length,
                "written_at": header.written_at,
            }
        if self.last_checkpoint is not None:
            checkpoint = self.last_checkpoint
            report["checkpoint"] = {
                "commit": checkpoint.commit,
                "bytes": checkpoint.nbytes,
                "path": str(checkpoint.path),
                "written_at": checkpoint.written_at,
            }
        return report

    def tick(self) -> None:
        """Collect a finished flush; start the next one when it is due and there is a newer commit."""
        if self._flushing is not None:
            if not self._flushing.done():
                return
            self._collect(self._flushing)
            self._flushing = None
        if self.checkpoint_dir is None or time.monotonic() < self._next_flush_at:
            return
        header = self.newest()
        done = self.last_checkpoint.commit if self.last_checkpoint else 0
        if header is None or header.commit <= done:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._next_flush_at = time.monotonic() + self.checkpoint_interval
        self._flushing = self._executor.submit(
            durable.flush, layout.buffer_paths(self.prefix), self.checkpoint_dir, self.host, done
        )

    def flush_now(self) -> None:
        """Write the newest commit to --checkpoint-dir now, after any flush under way: a host that drains (a
        preemption) leaves its last commit on disk, not only the one of the last interval."""
        if self._flushing is not None:
            self._collect(self._flushing)
            self._flushing = None
        header = self.newest()
        done = self.last_checkpoint.commit if self.last_checkpoint else 0
        if self.checkpoint_dir is None or header is None or header.commit <= done:
            return
        flushing: Future[durable.Checkpoint | None] = Future()
        try:
            flushing.set_result(durable.flush(layout.buffer_paths(self.prefix), self.checkpoint_dir, self.host, done))
        except OSError as exc:
            flushing.set_exception(exc)
        self._collect(flushing)

    def _collect(self, flushing: Future[durable.Checkpoint | None]) -> None:
        try:
            checkpoint = flushing.result()
        except OSError as exc:
            self.log.warning("checkpoint_failed", directory=str(self.checkpoint_dir), reason=f"{exc.strerror or exc}")
            return
        if checkpoint is not None:
            self.last_checkpoint = checkpoint
            self.log.info(
                "checkpoint_written",
                path=str(checkpoint.path),
                commit=checkpoint.commit,
                bytes=checkpoint.nbytes,
                seconds=round(checkpoint.seconds, 3),
            )

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        layout.remove(self.prefix)
