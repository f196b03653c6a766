"""A round as the services and agents share it: Horovod's slot assignment (`get_host_assignments`), exactly, and the
round written as its hosts. Part of the wire contract: the rendezvous assigns, the registry records, an agent computes
its slots again from the `round` event.

Hosts are filled in the order given (oldest first), one rank per slot, until
`max_np` ranks are placed. `cross_rank` of a slot is its index among the slots
with the same local rank on other hosts, `cross_size` the number of such slots.

A host is given as its slot count n (slots 0..n-1, Horovod's case) or as the
ids of its usable slots. A slot keeps its id as its local rank, so a worker
keeps its GPU while a crashed neighbour on its host restarts; while such a
hole exists a local rank may be >= local_size.

A round travels as its hosts in rank order, each with the ids of the slots it
uses (`round_hosts`): a few bytes per host instead of a record per slot, and
anyone holding it computes the slots again (`get_host_assignments(hosts, 0)`,
or `slots_of` for one host's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_SLOTS_PER_HOST = 1024  # the most slots one host may offer (an agent, discovery and the rendezvous refuse more)


@dataclass(frozen=True)
class SlotInfo:
    hostname: str
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostname": self.hostname,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "cross_rank": self.cross_rank,
            "size": self.size,
            "local_size": self.local_size,
            "cross_size": self.cross_size,
        }


class NotEnoughSlots(ValueError):
    """Fewer slots than min_np."""


def get_host_assignments(
    hosts: Sequence[tuple[str, int | Sequence[int]]], min_np: int, max_np: int | None = None
) -> list[SlotInfo]:
    """Assign ranks to the slots of `hosts` ([(hostname, slots or slot ids)], in assignment order)."""
    host_ranks: list[tuple[str, list[tuple[int, int]]]] = []
    cross_ranks: dict[int, dict[str, int]] = defaultdict(dict)
    rank = 0
    for hostname, slots in hosts:
        ranks = []
        for local_rank in range(slots) if isinstance(slots, int) else slots:
            if rank == max_np:
                break
            ranks.append((local_rank, rank))
            rank += 1
            at_local = cross_ranks[local_rank]
            at_local[hostname] = len(at_local)
        host_ranks.append((hostname, ranks))

    world_size = rank
    if world_size < min_np:
        raise NotEnoughSlots(f"{world_size} slot(s) available, at least {min_np} required")

    assignments = []
    for hostname, ranks in host_ranks:
        for local_rank, rank in ranks:
            at_local = cross_ranks[local_rank]
            assignments.append(
                SlotInfo(
                    hostname=hostname,
                    rank=rank,
                    local_rank=local_rank,
                    cross_rank=at_local[hostname],
                    size=world_size,
                    local_size=len(ranks),
                    cross_size=len(at_local),
                )
            )
    return assignments


def round_hosts(slots: Sequence[SlotInfo]) -> list[list[Any]]:
    """The hosts of an assignment in rank order, each as [name, [slot ids in rank order]]."""
    hosts: dict[str, list[int]] = {}
    for slot in sorted(slots, key=lambda s: s.rank):
        hosts.setdefault(slot.hostname, []).append(slot.local_rank)
    return [[name, ids] for name, ids in hosts.items()]


def slots_of(hosts: Sequence[Sequence[Any]], hostname: str) -> list[SlotInfo]:
    """The slots of `hostname` in the round whose hosts are `hosts` (as `round_hosts` writes them)."""
    return [s for s in get_host_assignments([(name, ids) for name, ids in hosts], 0) if s.hostname == hostname]
