"""The worker's side of its host's snapshot: whether this process writes it, and what a fresh worker restores from.

The agent creates the host's two snapshot buffers for the job and names them in
the worker's environment (`ELASTIC_SNAPSHOT`, the buffers' path prefix;
`ELASTIC_JOB_KEY`, the job they belong to). In each round the lowest rank on
each host writes them at every commit (`snapshot_writer` in its slot info; in
torchrun mode `ELASTIC_SNAPSHOT_WRITER`, set by the slot's supervisor):
data-parallel ranks hold the same committed state, so one copy per host is
enough. A fresh worker restores the newest of its host's snapshot and, with
`--checkpoint-dir` (`ELASTIC_CHECKPOINT_DIR`), the newest complete checkpoint
there; a checkpoint resumes a new job, so it is not checked against the job.
The writer tells its agent how long each commit's save took (`report_commit`),
for the agent's metric `elastic_commit_seconds`, and when a round's state is
synced (`report_resumed`): both go on to the registry's goodput ledger.
"""

from __future__ import annotations

import os
from pathlib import Path

from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.slot_processes.agent_link import say
from elastic_control_plane.snapshot.durable import trusted_checkpoint_files
from elastic_control_plane.snapshot.layout import buffer_paths, newest_header
from elastic_control_plane.snapshot.store import Snapshot, SnapshotWriter, read_newest
from libworker.world import world

_writer: SnapshotWriter | None = None


def writer() -> SnapshotWriter | None:
    """The host snapshot's writer when this process writes it this round, else None."""
    global _writer
    prefix, job = os.environ.get(WorkerEnv.SNAPSHOT), os.environ.get(WorkerEnv.JOB_KEY, "")
    if not prefix or not writes_this_round():
        return None
    if _writer is None or (_writer.prefix, _writer.job) != (prefix, job):
        if _writer is not None:
            _writer.close()
        _writer = SnapshotWriter(prefix, job)
    return _writer


def writes_this_round() -> bool:
    """Whether this process writes its host's snapshot in this round: libworker's join says so, or in torchrun mode
    (no join in this process) the slot's supervisor (`ELASTIC_SNAPSHOT_WRITER`)."""
    if world.slot:
        return bool(world.slot.get("snapshot_writer"))
    return os.environ.get(WorkerEnv.SNAPSHOT_WRITER) == "1"


def report_commit(seconds: float) -> None:
    """Tell the agent that this commit's save took `seconds`, when this process wrote it into the host's snapshot
    (a one-way message: the commit does not wait for the agent)."""
    if _writer is not None and world.slot.get("snapshot_writer") and world.link is not None:
        world.link.notify("committed", {"seconds": seconds})


def report_resumed() -> None:
    """Tell the agent that this round's state is synced and training resumes, when this process is its host's
    snapshot writer (one per host; one-way): the registry's goodput ledger ends the round's re-forming there."""
    if world.slot.get("snapshot_writer") and world.link is not None:
        world.link.notify("resumed", {"round": world.round})


def host_snapshot() -> Snapshot | None:
    """This job's newest verified snapshot on this host, or None."""
    prefix = os.environ.get(WorkerEnv.SNAPSHOT)
    return read_newest(buffer_paths(prefix), os.environ.get(WorkerEnv.JOB_KEY, ""), _rejected) if prefix else None


def restorable() -> Snapshot | None:
    """What a worker that holds no state restores from: the newer of the host's snapshot and the newest checkpoint
    (either falls back to the other when it fails verification), or None."""
    prefix, directory = os.environ.get(WorkerEnv.SNAPSHOT), os.environ.get(WorkerEnv.CHECKPOINT_DIR)
    host_paths = list(buffer_paths(prefix)) if prefix else []
    durable_paths = trusted_checkpoint_files(Path(directory), _rejected) if directory else []
    host_newest, durable_newest = newest_header(host_paths), newest_header(durable_paths)
    durable_first = durable_newest is not None and (host_newest is None or durable_newest.commit > host_newest.commit)
    sources = [(durable_paths, None), (host_paths, os.environ.get(WorkerEnv.JOB_KEY, ""))]
    for paths, job in sources if durable_first else reversed(sources):
        found = read_newest(paths, job, _rejected) if paths else None
        if found is not None:
            say(
                f"resuming from checkpoint {found.path} (job {found.job}, commit {found.commit})"
                if job is None
                else f"restored commit {found.commit} from this host's snapshot {found.path}"
            )
            return found
    return None


def _rejected(path: str, reason: str) -> None:
    say(f"not restoring {path}: {reason}")
