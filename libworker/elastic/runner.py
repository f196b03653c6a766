"""`@run`: the elastic training loop around a user's `train(state)` (Horovod's `hvd.elastic.run`).

On entry the state is synced. On WorkerInternalError the state is restored to
the last commit; on HostsUpdatedInterrupt it is kept. Either way the worker
enters the next round again, `state.on_reset()` runs (reset callbacks), and the
ranks agree collectively whether to sync and from which rank.

A process that holds no state yet (the job's start, a respawned worker, a
whole job resuming) first restores the newest commit it finds on its host
(the host's snapshot, or a `--checkpoint-dir` checkpoint). Then one allreduce
compares every rank's commit counter: the source is the lowest rank holding
the newest commit, and a sync happens only when some rank holds an older one
(or nobody holds any state: the job's start, from rank 0). A rank whose live
state went on past its last commit (interrupted by a `check_host_updates()`
between commits) counts as newer than that commit. So a respawned worker
never overwrites the job's state with its fresh one, and a worker that
restored the current commit from its host needs no broadcast.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from libworker.elastic import snapshots
from libworker.elastic.state import State
from libworker.errors import HostsUpdatedInterrupt, WorkerInternalError
from libworker.mpi_ops import Max, allreduce_
from libworker.world import enter_next_round, world

T = TypeVar("T")


def _agreed_sync(state: State) -> None:
    """One allreduce of (newest state, lowest rank holding it) and of the oldest state decides for all ranks. A
    state's level is twice its commit counter, plus one when its live state went on past that commit (a
    `check_host_updates()` between commits interrupted it: the live state, not the commit, is the job's)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    held = 2 * state._commits + int(state._live_ahead) if world.holds_state else -1
    newest_first = (held + 1) * (size + 1) + (size - rank)
    agreed = allreduce_(torch.tensor([newest_first, -(held + 1)], dtype=torch.int64), op=Max)
    newest = int(agreed[0].item()) // (size + 1) - 1
    root = size - int(agreed[0].item()) % (size + 1)
    oldest = -int(agreed[1].item()) - 1
    if newest < 0 or oldest < newest:
        state.sync(root_rank=root)
        state._live_ahead = False
    world.holds_state = True


def _restore_from_host(state: State) -> None:
    """A process that holds no state takes the newest commit found on its host, if its State can load one. That
    commit was taken before the reset the others just went through, so it goes through it too: `on_reset` (the
    state's reset and the reset callbacks, e.g. a learning rate scaled to the new world size), as the survivors
    did after entering the round."""
    found = snapshots.restorable()
    if found is not None and state.load_snapshot(found):
        state.on_reset()
        world.holds_state = True


def run(func: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if not world.slot:
            enter_next_round()
        world.listeners.append(state)
        reenter = False
        try:
            while True:
                try:
                    if reenter:
                        enter_next_round()
                        state.on_reset()
                    state.on_round_entered()
                    if not world.holds_state:
                        _restore_from_host(state)
                    _agreed_sync(state)
                    snapshots.report_resumed()
                    return func(state, *args, **kwargs)
                except WorkerInternalError:
                    state.restore()
                    state._live_ahead = False
                except HostsUpdatedInterrupt:
                    pass
                reenter = True
        finally:
            world.listeners.remove(state)

    return wrapper
