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

No rank ever waits on that store. The store is served by the round's rank 0,
and a TCPStore call to a server that hangs (its host froze) blocks far past
the client's timeout (measured: minutes against a SIGSTOPped server), while a
rank waiting in an operation must stay free to see the control plane's abort.
So one daemon thread per round (`NoticeBoard`) makes every store call: the
others post what they write and read what it last fetched. A thread caught in
a call to a hung server ends when that call fails (the server's process dies);
otherwise it ends with its round (`close`).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from libworker.collectives import fail
from libworker.world import world

NOTICES = "elastic_join/notices"
POLL_SLEEP_MAX = 0.01
CYCLE = "cycle"
STEP = "step:"


def answer_key(operation: int) -> str:
    return f"elastic_join/answer/{operation}"


class Notice(NamedTuple):
    """Rank `rank` joined after taking part in `operations` operations of the set."""

    rank: int
    operations: int


def parse_notices(text: str) -> list[Notice]:
    """The notices appended to the store's key, in the order they came."""
    return [Notice(*map(int, entry.split(":"))) for entry in text.split(";")[:-1]]


def all_joined_after(notices: list[Notice], operations: int, size: int) -> bool:
    """Whether every rank of the set sent a notice after the same `operations` operations."""
    return len({notice.rank for notice in notices if notice.operations == operations}) == size


@dataclass
class Unanswered:
    """The notices one waiting rank has taken in so far, and those it has not answered or passed yet."""

    taken: int = 0
    waiting: list[Notice] = field(default_factory=list)

    def answers(self, notices: list[Notice], waiting_in: dict[int, str]) -> dict[int, str]:
        """What to answer under each operation number: for every notice whose next operation is one this rank
        waits in (`waiting_in`: number -> what). Notices of joiners this rank has not reached yet are kept for
        later; those it has passed are dropped (a rank that waited there answered them)."""
        self.waiting.extend(notices[self.taken :])
        self.taken = max(self.taken, len(notices))
        newest = max(waiting_in, default=0)
        found, kept = {}, []
        for notice in self.waiting:
            what = waiting_in.get(notice.operations + 1)
            if what is not None:
                found[notice.operations + 1] = what
            elif notice.operations + 1 > newest:
                kept.append(notice)
        self.waiting = kept
        return found


class NoticeBoard:
    """One round's join notices, kept by the one thread that calls the store (see the module's docstring).

    `announce` and `answer` post writes; `refresh` asks for a fetch of the notices (and of the answer to one
    operation), at most one fetch queued at a time; `notices` and `answers` hold what the last fetch found.
    None of them waits for the store; `await_answer` (a joining rank) waits only for what the thread fetches.
    """

    def __init__(self, store: Any) -> None:
        self._store = store
        self._requests: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._fetch_queued = False
        self._closed = False
        self.notices: list[Notice] = []
        self.answers: dict[int, str] = {}
        self._thread = threading.Thread(target=self._serve, name="join-notices", daemon=True)
        self._thread.start()

    def announce(self, notice: Notice) -> None:
        self._requests.put(lambda: self._store.append(NOTICES, f"{notice.rank}:{notice.operations};"))

    def answer(self, operation: int, what: str) -> None:
        self._requests.put(lambda: self._store.set(answer_key(operation), what))

    def refresh(self, answer_to: int | None = None) -> None:
        if self._fetch_queued:
            return
        self._fetch_queued = True
        self._requests.put(lambda: self._fetch(answer_to))

    def await_answer(self, notice: Notice, size: int) -> str | None:
        """Post `notice` (this rank joined) and wait for what the others' next operation is: CYCLE, or STEP and
        a layout's name; None when all `size` ranks of the set joined after the same operation. Like a
        collective's wait, it ends at the control plane's abort or after the collective timeout."""
        self.announce(notice)
        operation = notice.operations + 1
        round_number = world.round
        deadline = time.monotonic() + world.timing.collective_timeout
        idle = 0
        while (what := self.answers.get(operation)) is None:
            if all_joined_after(self.notices, notice.operations, size):
                return None
            if world.aborted_round == round_number:
                raise fail("aborted by the control plane while joining (a peer failed)")
            if time.monotonic() > deadline:
                raise fail(f"no rank answered this rank's join within {world.timing.collective_timeout:g}s")
            self.refresh(answer_to=operation)
            idle += 1
            time.sleep(min(0.0005 * idle, POLL_SLEEP_MAX))
        return what

    def close(self) -> None:
        """The round ended: the thread ends, leaving what is still posted (no rank of the round needs it)."""
        self._closed = True
        self._requests.put(None)

    def _fetch(self, answer_to: int | None) -> None:
        try:
            if self._store.check([NOTICES]):
                self.notices = parse_notices(self._store.get(NOTICES).decode())
            if answer_to is not None and self._store.check([answer_key(answer_to)]):
                self.answers = {**self.answers, answer_to: self._store.get(answer_key(answer_to)).decode()}
        finally:
            self._fetch_queued = False

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None and not self._closed:
            try:
                request()
            except RuntimeError:
                continue  # the store's server is gone with its round: the waits that need it end at the abort
        self._store = None  # rank 0's store is its server too: let it go with the round, not with this object
