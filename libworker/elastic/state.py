"""State objects with Horovod Elastic's semantics: commit = save + check_host_updates; restore; sync; on_reset.

`check_host_updates` is collective: every rank contributes the newest pending
host-update timestamp and the kinds of change it saw; an allreduce-max makes
all ranks agree, so an update first seen by any rank counts, and all raise
HostsUpdatedInterrupt at the same commit. Updates older than the host set the
current round was built from are ignored (they are what made this round).

Every State counts its commits (`_commits`, part of the state: sync sends it),
and knows whether its live state may be ahead of the last commit
(`_live_ahead`: it was interrupted by a `check_host_updates()` called between
commits, so it keeps training state that no commit holds). The library keeps
its bookkeeping in `_` names: as in Horovod, a State's public names are its
methods and the user's attributes (`ObjectState(commits=0)` is the user's).
ObjectState and TorchState refuse with ValueError a keyword that would shadow
a method (`commit=`, `save=`, ...) or that starts with `_`. The tree a commit
writes and sync sends is `{"commits": N, "objects": {the user's attributes},
"torch": {state_dicts}}`: the user's names live only under "objects".
ObjectState and TorchState also write each commit into their host's snapshot
when this process is the host's snapshot writer (libworker.elastic.snapshots);
the writer keeps no second copy of its tensors in memory: its restore reads
them back from the snapshot. Sync sends tensors as flat buffers
(`broadcast_tree`), never pickled.
"""

from __future__ import annotations

import copy
import queue
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from elastic_control_plane.snapshot.store import Snapshot
from libworker.elastic import snapshots
from libworker.elastic.transfer import broadcast_tree
from libworker.errors import HostsUpdatedInterrupt
from libworker.mpi_ops import Max, allreduce_
from libworker.world import HOST_ADDED, HOST_REMOVED, world


class State:
    """Base: subclasses implement save, restore, sync(root_rank) and reset."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._host_messages: queue.Queue[tuple[float, int]] = queue.Queue()
        self._last_updated_timestamp = 0.0
        self._commits = 0
        self._live_ahead = False
        self._committing = False

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """After re-joining: drop host updates the new round already reflects, run reset and the callbacks.

        Updates newer than the round's host set are kept: they may have arrived
        while this worker was re-joining, and the round does not include them.
        """
        built_from = float(world.slot.get("hosts_timestamp", 0.0))
        pending, self._host_messages = self._host_messages, queue.Queue()
        while not pending.empty():
            timestamp, update = pending.get_nowait()
            if timestamp > built_from:
                self._host_messages.put((timestamp, update))
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update: int) -> None:
        self._host_messages.put((timestamp, update))

    def commit(self) -> None:
        started = time.monotonic()
        self.save()
        snapshots.report_commit(time.monotonic() - started)
        self._commits += 1
        self._live_ahead = False
        self._committing = True
        try:
            self.check_host_updates()
        finally:
            self._committing = False

    def check_host_updates(self) -> None:
        seen_since = max(self._last_updated_timestamp, float(world.slot.get("hosts_timestamp", 0.0)))
        newest, update = seen_since, 0
        while not self._host_messages.empty():
            timestamp, kind = self._host_messages.get_nowait()
            if timestamp > seen_since:
                newest, update = max(newest, timestamp), update | kind
        agreed = allreduce_(
            torch.tensor([newest, float(update & HOST_ADDED), float(bool(update & HOST_REMOVED))], dtype=torch.float64),
            op=Max,
        )
        if agreed[0].item() > seen_since:
            self._last_updated_timestamp = agreed[0].item()
            added, removed = agreed[1].item() > 0, agreed[2].item() > 0
            self._live_ahead = self._live_ahead or not self._committing
            raise HostsUpdatedInterrupt(skip_sync=removed and not added)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root_rank: int = 0) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after re-joining, before reset callbacks and sync."""

    def load_snapshot(self, snapshot: Snapshot) -> bool:
        """Take a snapshot's commit as this process's state (a fresh worker restoring); False: not supported."""
        return False

    def on_round_entered(self) -> None:
        """Called after every join, before sync: the round may have changed who writes the host's snapshot."""


def _refuse_library_names(state: State, names: Iterable[str]) -> None:
    """ValueError for a state attribute that would shadow a name the library defines on `state`'s class (a method)
    or that starts with `_` (the library's bookkeeping)."""
    kind = type(state).__name__
    library = [vars(cls) for cls in type(state).__mro__ if cls.__module__ == __name__]
    for name in names:
        if name.startswith("_"):
            raise ValueError(
                f"{kind}({name}=...): names starting with '_' are reserved for {kind}'s own bookkeeping; pick "
                "another name for your state attribute"
            )
        owner = next((attrs for attrs in library if name in attrs), None)
        if owner is not None:
            what = "a method" if callable(owner[name]) else "an attribute"
            raise ValueError(
                f"{kind}({name}=...): {name!r} is {what} of {kind}; pick another name for your state attribute"
            )


class ObjectState(State):
    """Plain picklable Python objects, kept as attributes: `ObjectState(epoch=0, batch=0)`. A keyword may not be
    the name of one of the class's methods nor start with `_` (ValueError)."""

    def __init__(self, **kwargs: Any) -> None:
        _refuse_library_names(self, kwargs)
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        self._capture(self._commits + 1)

    def _capture(self, commit: int) -> None:
        """Keep the live values as the committed state `commit`, and write it into the host's snapshot when this
        process writes it (SnapshotError, e.g. a full /dev/shm, leaves the previous snapshot intact)."""
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}
        out = snapshots.writer()
        if out is not None:
            out.write(commit, {"commits": commit, **self._committed_tree()})

    def _committed_tree(self) -> dict[str, Any]:
        return {"objects": self._saved_state}

    def _live_tree(self) -> dict[str, Any]:
        return {"objects": {name: getattr(self, name) for name in self._saved_state}}

    def _load_tree(self, tree: dict[str, Any], commit: int) -> None:
        """Make `tree` the live state, as of commit `commit` (the caller keeps it as committed)."""
        self._saved_state = dict(tree["objects"])
        self._set_attrs()
        self._commits = commit

    def restore(self) -> None:
        self._set_attrs()

    def sync(self, root_rank: int = 0) -> None:
        tree = broadcast_tree({"commits": self._commits, **self._live_tree()}, root_rank)
        self._load_tree(tree, tree["commits"])
        self._capture(self._commits)

    def load_snapshot(self, snapshot: Snapshot) -> bool:
        self._load_tree(snapshot.tree, snapshot.commit)
        self._capture(snapshot.commit)
        return True


class _Handler:
    """Save/restore of one stateful object through its state_dict. `saved` is None while the committed copy lives
    only in the host's snapshot (this process writes it)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved: Any = self._copy()

    def _copy(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def save(self, in_snapshot: bool) -> None:
        self.saved = None if in_snapshot else self._copy()

    def committed(self) -> Any:
        return self.value.state_dict() if self.saved is None else self.saved

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def reset(self) -> None:
        if hasattr(self.value, "reset"):
            self.value.reset()


class TorchState(ObjectState):
    """Model, optimizer, samplers (anything with state_dict/load_state_dict) plus plain values.

    `TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)`. Keywords as for ObjectState.
    """

    def __init__(
        self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any
    ) -> None:
        _refuse_library_names(self, kwargs)
        stateful = {"model": model, "optimizer": optimizer}
        stateful.update({k: v for k, v in kwargs.items() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")})
        self._handlers = {name: _Handler(value) for name, value in stateful.items() if value is not None}
        for name, handler in self._handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._handlers})

    def _capture(self, commit: int) -> None:
        in_snapshot = snapshots.writer() is not None
        for handler in self._handlers.values():
            handler.save(in_snapshot)
        super()._capture(commit)

    def _committed_tree(self) -> dict[str, Any]:
        return {**super()._committed_tree(), "torch": {name: h.committed() for name, h in self._handlers.items()}}

    def _live_tree(self) -> dict[str, Any]:
        return {**super()._live_tree(), "torch": {name: h.value.state_dict() for name, h in self._handlers.items()}}

    def _load_tree(self, tree: dict[str, Any], commit: int) -> None:
        for name, handler in self._handlers.items():
            handler.value.load_state_dict(tree["torch"][name])
        super()._load_tree(tree, commit)

    def restore(self) -> None:
        """Back to the last commit; the snapshot writer reads its tensors back from the host's snapshot."""
        if any(h.saved is None for h in self._handlers.values()):
            self._restore_from_host_snapshot()
            return
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def _restore_from_host_snapshot(self) -> None:
        found = snapshots.host_snapshot()
        if found is None:
            raise RuntimeError(
                "the committed state is lost: this process kept it only in the host's snapshot, which is gone"
            )
        self._load_tree(found.tree, found.commit)
        for handler in self._handlers.values():
            handler.saved = None

    def on_round_entered(self) -> None:
        """A process that kept its committed tensors only in the host's snapshot and no longer writes it takes a
        private copy now, before the new writer overwrites the slots."""
        if snapshots.writer() is None and any(h.saved is None for h in self._handlers.values()):
            found = snapshots.host_snapshot()
            if found is None:
                raise RuntimeError("the committed state is lost: the host's snapshot is gone")
            if found.commit != self._commits:
                self._load_tree(found.tree, found.commit)
            for name, handler in self._handlers.items():
                handler.saved = found.tree["torch"][name]

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
