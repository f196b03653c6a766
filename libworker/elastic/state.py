"""State objects with Horovod Elastic's semantics: commit = save + check_host_updates; restore; sync; on_reset.

`check_host_updates` is collective: every rank contributes the newest pending
host-update timestamp and the kinds of change it saw; an allreduce-max makes
all ranks agree, so an update first seen by any rank counts, and all raise
HostsUpdatedInterrupt at the same commit. Updates older than the host set the
current round was built from are ignored (they are what made this round).
"""

from __future__ import annotations

import copy
import queue
from collections.abc import Callable
from typing import Any

import torch

from libworker.functions import broadcast_object
from libworker.mpi_ops import Max, allreduce_
from libworker.errors import HostsUpdatedInterrupt
from libworker.world import HOST_ADDED, HOST_REMOVED, world


class State:
    """Base: subclasses implement save, restore, sync(root_rank) and reset."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []
        self._host_messages: queue.Queue[tuple[float, int]] = queue.Queue()
        self._last_updated_timestamp = 0.0

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
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        seen_since = max(self._last_updated_timestamp, float(world.slot.get("hosts_timestamp", 0.0)))
        newest, update = seen_since, 0
        while not self._host_messages.empty():
            timestamp, kind = self._host_messages.get_nowait()
            if timestamp > seen_since:
                newest, update = max(newest, timestamp), update | kind
        agreed = allreduce_(
            torch.tensor([newest, float(update & HOST_ADDED), float(bool(update & HOST_REMOVED))], dtype=torch.float64), op=Max
        )
        if agreed[0].item() > seen_since:
            self._last_updated_timestamp = agreed[0].item()
            added, removed = agreed[1].item() > 0, agreed[2].item() > 0
            raise HostsUpdatedInterrupt(skip_sync=removed and not added)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root_rank: int = 0) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called after re-joining, before reset callbacks and sync."""


class ObjectState(State):
    """Plain picklable Python objects, kept as attributes: `ObjectState(epoch=0, batch=0)`."""

    def __init__(self, **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self, root_rank: int = 0) -> None:
        if self._saved_state:
            self.save()
            self._saved_state = broadcast_object(self._saved_state, root_rank)
            self._set_attrs()


class _Handler:
    """Save/restore/sync of one stateful object through its state_dict."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = self._copy()

    def _copy(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self.saved = self._copy()

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def load(self, state: Any) -> None:
        self.value.load_state_dict(state)
        self.saved = self._copy()

    def reset(self) -> None:
        if hasattr(self.value, "reset"):
            self.value.reset()


class TorchState(ObjectState):
    """Model, optimizer, samplers (anything with state_dict/load_state_dict) plus plain values.

    `TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0)`.
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None, **kwargs: Any) -> None:
        stateful = {"model": model, "optimizer": optimizer}
        stateful.update({k: v for k, v in kwargs.items() if hasattr(v, "state_dict") and hasattr(v, "load_state_dict")})
        self._handlers = {name: _Handler(value) for name, value in stateful.items() if value is not None}
        for name, handler in self._handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in self._handlers})

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self, root_rank: int = 0) -> None:
        for handler in self._handlers.values():
            handler.save()
        saved = broadcast_object({name: h.saved for name, h in self._handlers.items()}, root_rank)
        for name, handler in self._handlers.items():
            handler.load(saved[name])
        super().sync(root_rank)

    def reset(self) -> None:
        for handler in self._handlers.values():
            handler.reset()
