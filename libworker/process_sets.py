"""Horovod's process sets: subsets of the round's ranks that run collectives among themselves.

`ProcessSet([0, 2])` names global ranks; `init(process_sets=[...])` or the
collective `add_process_set(...)` (every rank calls it) registers it, and
`process_set=` on any op runs that op over the set's own process group, with
its own negotiation (libworker.negotiation). `global_process_set` is every
rank of the round (id 0).

In an elastic job the registry outlives the round: at every join the ranks
agree on one registry (the longest one any rank holds, lowest rank first, so
a worker that just started learns the sets the others made) and each set's
process group is built again over the new round. A set is the rank numbers it
was made with (ranks are renumbered from 0 on every reset): in a round of
fewer ranks its members are those of its ranks that exist (`ranks` says which),
and when the job grows back its other ranks are members again. Using a set
none of whose ranks is in the round raises ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from libworker.collectives import run_collective
from libworker.world import require_joined, world


class ProcessSet:
    """A set of global ranks; `process_set_id` is set once it is registered (None before, and after removal)."""

    def __init__(self, ranks: Sequence[int] = ()) -> None:
        ranks = sorted(ranks)
        if any(not isinstance(rank, int) or isinstance(rank, bool) for rank in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks (ints)")
        self.requested: list[int] = ranks
        self.ranks: list[int] = list(ranks)
        self.process_set_id: int | None = None

    def size(self) -> int | None:
        """Ranks in the set, or None when it is not registered."""
        return None if self.process_set_id is None else len(self._ranks())

    def rank(self) -> int | None:
        """This process's rank within the set (None when the set is not registered or this process is not a member)."""
        return None if self.process_set_id is None else self.rank_in(int(require_joined()["rank"]))

    def rank_in(self, global_rank: int) -> int | None:
        """The position of `global_rank` in the set, or None when it is not a member."""
        ranks = self._ranks()
        return ranks.index(global_rank) if global_rank in ranks else None

    def included(self) -> bool | None:
        """Whether this process is a member (None when not registered)."""
        return None if self.process_set_id is None else int(require_joined()["rank"]) in self._ranks()

    def _ranks(self) -> list[int]:
        return list(range(int(require_joined()["size"]))) if self.process_set_id == 0 else self.ranks

    def __repr__(self) -> str:
        extra = "" if self.ranks == self.requested else f", of {self.requested}"
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}{extra})"


global_process_set = ProcessSet()
global_process_set.process_set_id = 0


@dataclass
class _Registry:
    """Registered sets by id, and their process groups in the round they were built for."""

    sets: dict[int, ProcessSet]
    groups: dict[int, Any]
    next_id: int = 1


_registry = _Registry({}, {})


def _as_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    return process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)


def register(process_sets: Sequence[ProcessSet | Sequence[int]]) -> list[ProcessSet]:
    """Register sets before the first join (`init(process_sets=...)`); their groups are built at the join."""
    registered = []
    for candidate in process_sets:
        process_set = _as_set(candidate)
        if not process_set.ranks:
            raise ValueError("a process set needs at least one rank (the global set is global_process_set)")
        existing = next((s for s in _registry.sets.values() if s.requested == process_set.requested), None)
        if existing is not None:
            process_set.process_set_id = existing.process_set_id
        else:
            process_set.process_set_id = _registry.next_id
            _registry.sets[_registry.next_id] = process_set
            _registry.next_id += 1
        registered.append(process_set)
    return registered


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a set while the job runs; collective: every rank of the round calls it, in the same order. A call
    that raises registers nothing, so the next call with the same ranks is no duplicate; where it raised on some
    ranks only (a peer died while the group was built), the round is aborted and the next join agrees on one
    registry (`rebuild_for_round`)."""
    slot = require_joined()
    process_set = _as_set(process_set)
    if any(not 0 <= rank < int(slot["size"]) for rank in process_set.ranks) or not process_set.ranks:
        raise ValueError(f"process set ranks {process_set.ranks} must be ranks of this round (size {slot['size']})")
    if any(s.requested == process_set.requested for s in _registry.sets.values()):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    group = dist.new_group(process_set.ranks)  # first: a set whose group failed to build is not registered
    (registered,) = register([process_set])
    _registry.groups[registered.process_set_id] = group
    return registered


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set (collective, like add_process_set); False for the global set or one not registered."""
    set_id = process_set.process_set_id
    if set_id in (None, 0) or set_id not in _registry.sets:
        return False
    group = _registry.groups.pop(set_id, None)
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        dist.destroy_process_group(group)
    _registry.sets.pop(set_id).process_set_id = None
    process_set.process_set_id = None
    return True


def rebuild_for_round() -> None:
    """After a join: agree on one registry across the round, then build every set's group over the new ranks."""
    _registry.groups.clear()
    mine = _agreed_registry(sorted((set_id, s.requested) for set_id, s in _registry.sets.items()))
    size = dist.get_world_size()
    known = {tuple(s.requested): s for s in _registry.sets.values()}
    _registry.sets.clear()
    for set_id, requested in mine:
        process_set = known.pop(tuple(requested), None) or ProcessSet(requested)
        process_set.ranks = [rank for rank in requested if rank < size]
        process_set.process_set_id = set_id
        _registry.sets[set_id] = process_set
        if process_set.ranks:
            _registry.groups[set_id] = dist.new_group(process_set.ranks)
        _registry.next_id = max(_registry.next_id, set_id + 1)
    for orphan in known.values():
        orphan.process_set_id = None


world.round_entered_hooks.append(rebuild_for_round)


def _agreed_registry(mine: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
    """The longest registry any rank of the round holds (lowest rank first): one small allreduce when no rank has
    a set, else a broadcast of it too; abortable, like every collective of libworker."""
    size, rank = dist.get_world_size(), dist.get_rank()
    if size == 1:
        return mine
    holder = torch.tensor([len(mine) * size + (size - 1 - rank)], dtype=torch.int64)
    run_collective(lambda: dist.all_reduce(holder, op=dist.ReduceOp.MAX, async_op=True))
    longest, source = divmod(int(holder.item()), size)
    if longest == 0:
        return []
    source = size - 1 - source
    payload = (
        torch.frombuffer(bytearray(msgpack.packb(mine)), dtype=torch.uint8)
        if rank == source
        else torch.empty(0, dtype=torch.uint8)
    )
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    run_collective(lambda: dist.broadcast(length, src=source, async_op=True))
    if rank != source:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    run_collective(lambda: dist.broadcast(payload, src=source, async_op=True))
    return [(int(set_id), list(ranks)) for set_id, ranks in msgpack.unpackb(payload.numpy().tobytes())]


def group_of(process_set: ProcessSet) -> Any:
    """The torch process group of a set this rank belongs to (None: the round's default group)."""
    if process_set.process_set_id == 0 or process_set is global_process_set:
        return None
    if process_set.process_set_id is None or process_set.process_set_id not in _registry.sets:
        raise ValueError(
            f"{process_set} is not registered (add_process_set or init(process_sets=...)), or its ranks left the job"
        )
    if not process_set.ranks:
        raise ValueError(f"none of the ranks of {process_set} is in this round (size {require_joined()['size']})")
    if not process_set.included():
        raise ValueError(f"rank {require_joined()['rank']} is not a member of {process_set}")
    return _registry.groups[process_set.process_set_id]


def registered_id(process_set: ProcessSet) -> int:
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered (add_process_set or init(process_sets=...))")
    return process_set.process_set_id
