"""Join notices: how a rank that calls join() learns, through the round's store, which operation the others wait in.

On the global process set a training step whose layout every rank agreed on
starts unannounced (libworker.negotiation), so a rank that calls join()
cannot tell whether the others' next operation is such a step or a
negotiation cycle. It appends a notice (its rank and how many operations of
the set it took part in) to one key of the store its default process group
was built on, and waits for the answer under the next operation's number. A
rank whose wait in an operation outlasts a slice (libworker.collectives runs
`world.stuck_hooks`) reads the notices and answers each one whose next
operation it is waiting in; every rank waiting there writes the same answer.
When every rank of the set sent a notice after the same operation, they all
joined at once, and none waits for an answer. Keys live in the round's store,
so a round's notices end with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NOTICES = "elastic_join/notices"
CYCLE = "cycle"
STEP = "step:"


def answer_key(operation: int) -> str:
    return f"elastic_join/answer/{operation}"


def announce(store: Any, rank: int, operations: int) -> None:
    """Tell every rank that `rank` joined after taking part in `operations` operations."""
    store.append(NOTICES, f"{rank}:{operations};")


def answer_to(store: Any, operation: int) -> str | None:
    """What the others wait in as operation number `operation` (CYCLE, or STEP + a layout's name), once answered."""
    key = answer_key(operation)
    return store.get(key).decode() if store.check([key]) else None


@dataclass
class Notices:
    """The notices of one round read so far, and those not yet answered or passed."""

    read: int = 0
    waiting: list[tuple[int, int]] = field(default_factory=list)

    def read_new(self, store: Any) -> None:
        if not store.check([NOTICES]):
            return
        entries = store.get(NOTICES).decode().split(";")[:-1]
        for entry in entries[self.read :]:
            rank, operations = entry.split(":")
            self.waiting.append((int(rank), int(operations)))
        self.read = len(entries)

    def answer(self, store: Any, waiting_in: dict[int, str]) -> None:
        """Answer each notice whose next operation is one this rank waits in (`waiting_in`: number -> what); keep
        those whose next operation this rank has not reached yet."""
        self.read_new(store)
        newest = max(waiting_in, default=0)
        kept = []
        for rank, operations in self.waiting:
            what = waiting_in.get(operations + 1)
            if what is not None:
                store.set(answer_key(operations + 1), what)
            elif operations + 1 > newest:
                kept.append((rank, operations))
        self.waiting = kept

    def all_joined_after(self, store: Any, operations: int, size: int) -> bool:
        """Whether every rank of the set sent a notice after the same `operations` operations."""
        self.read_new(store)
        return len({rank for rank, after in self.waiting if after == operations}) == size
