"""`@run`: the elastic training loop around a user's `train(state)` (Horovod's `hvd.elastic.run`).

On entry the state is synced. On WorkerInternalError the state is restored to
the last commit; on HostsUpdatedInterrupt it is kept. Either way the worker
re-joins the next round, `state.on_reset()` runs (reset callbacks), and the
ranks agree collectively whether to sync and from which rank: a sync happens
unless every rank skips it (only hosts removed, nobody new), and the source is
the lowest rank that holds the job's state (it trained or was synced in an
earlier round), so a respawned worker never overwrites the job's state with
its fresh one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from libworker.elastic.state import State
from libworker.errors import HostsUpdatedInterrupt, WorkerInternalError
from libworker.mpi_ops import Max, allreduce_
from libworker.world import join, world

T = TypeVar("T")


def _agreed_sync(state: State, skip_sync: bool) -> None:
    """One allreduce decides for all ranks whether to sync and from whom: the lowest rank that holds the job's state
    (it trained or was synced in an earlier round), or rank 0 when nobody does yet (the job's start)."""
    size = dist.get_world_size()
    wants_sync = 0.0 if skip_sync and world.holds_state else 1.0
    candidate = float(dist.get_rank() if world.holds_state else size)
    agreed = allreduce_(torch.tensor([wants_sync, -candidate], dtype=torch.float64), op=Max)
    if agreed[0].item() > 0:
        root = int(-agreed[1].item())
        state.sync(root_rank=0 if root == size else root)
    world.holds_state = True


def run(func: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if not world.slot:
            join()
        world.listeners.append(state)
        skip_sync, rejoin = False, False
        try:
            while True:
                try:
                    if rejoin:
                        join()
                        state.on_reset()
                    _agreed_sync(state, skip_sync)
                    return func(state, *args, **kwargs)
                except WorkerInternalError:
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as interrupt:
                    skip_sync = interrupt.skip_sync
                rejoin = True
        finally:
            world.listeners.remove(state)

    return wrapper
