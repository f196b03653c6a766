"""Horovod's join(): a rank out of data serves the others' allreduces with zeros until every rank has joined.

The whole protocol lives here; libworker.negotiation runs it in its cycles.

- **Join state** (`JoinState`). A rank in `join()` keeps cycling with the
  others and serves what they agree on with zeros (`serve_with_zeros`): an
  allreduce, a barrier, a DistributedOptimizer step (`JOIN_SERVABLE`; any
  other kind fails on every active rank meanwhile, as in Horovod:
  `refused_while_joined`). Each cycle
  tells every rank whether some rank is joined and whether all are; when all
  are, every rank returns the rank that joined last.
- **Control element.** The first bucket of a DistributedOptimizer step
  carries one more element (`with_control_element`): 0 from an active rank
  (`mark_active`), 1 from a rank serving the step as joined. Its sum
  (`joined_ranks_in`) tells every rank, at the same step, that a rank joined;
  it counts only where it is summed and arrives exact (`counts_joins`).
- **Unannounced steps** (`may_start_unannounced`). So a cached step whose
  data counts joined ranks starts with no cycle, on the global set, on CPU
  tensors, while no rank is joined.
- **Notices and answers** (`Operations`, `NoticeBoard`). Cycles and such
  steps are numbered alike, so a rank that calls join() cannot tell whether
  the others' next operation is such a step or a cycle. It appends a notice
  (its rank and how many operations of the set it took part in) to one key of
  the store its default process group was built on, and waits for the answer
  under the next operation's number. A rank whose wait in an operation
  outlasts a slice (libworker.collectives: `while_stuck`) reads the notices
  and answers each one whose next operation it is waiting in; every rank
  waiting there writes the same answer. When every rank of the set sent a
  notice after the same operation, they all joined at once, and none waits
  for an answer. Keys live in the round's store, so a round's notices end
  with it.

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

import torch
import torch.distributed as dist

from libworker.collectives import fail, run_collective, timed_out, waits_on_stream
from libworker.compression import Compressor, FP16Compressor, NoneCompressor
from libworker.reduction import Average, Sum, grouped_reduce_started
from libworker.signatures import Signature
from libworker.world import world

JOIN_SERVABLE = frozenset({"allreduce", "barrier", "optimizer"})
NOTICES = "elastic_join/notices"
NOTICE_POLL = 0.1
POLL_SLEEP_MAX = 0.01
CYCLE = "cycle"
STEP = "step:"


@dataclass
class JoinState:
    """Horovod's join on one process set, as this rank knows it."""

    joined: bool = False
    newly_joined: bool = False
    last_joiner: int | None = None
    someone_joined: bool = False

    def enter(self) -> None:
        """This rank calls join(): the next cycle tells the others (`newly_joined`)."""
        self.joined, self.newly_joined, self.last_joiner = True, True, None

    def leave(self) -> None:
        self.joined = self.newly_joined = False

    def all_joined(self, last_joiner: int) -> None:
        """A cycle found every rank joined: each returns `last_joiner`, and the next operation finds none joined."""
        self.last_joiner, self.someone_joined = last_joiner, False

    def count_step(self, joined_ranks: torch.Tensor | None) -> None:
        """An unannounced step ended; `joined_ranks` (its control element, None if it failed) counts the ranks that
        served it as joined."""
        if joined_ranks is not None and float(joined_ranks) > 0:
            self.someone_joined = True


def with_control_element(count: int) -> int:
    """The length of a step's first bucket: its `count` gradient elements and the control element after them."""
    return count + 1


def mark_active(buffer: torch.Tensor) -> None:
    """This rank takes part in the step with its own gradients."""
    buffer[-1] = 0


def mark_joined(buffer: torch.Tensor) -> None:
    """This rank is in join() and serves the step with zeros."""
    buffer[-1] = 1


def joined_ranks_in(result: torch.Tensor) -> torch.Tensor:
    """How many ranks served the step as joined: the reduced first bucket's control element."""
    return result[-1:]


def counts_joins(op: int, compression: type[Compressor]) -> bool:
    """Whether a step's control element counts joined ranks: only if it is summed and arrives exact (a 1 among 0s
    survives float16; a user's compressor might drop or quantize it away)."""
    return op in (Average, Sum) and compression in (NoneCompressor, FP16Compressor)


def may_start_unannounced(operations: Operations, join: JoinState, signature: Signature) -> bool:
    """Whether a cached step may start with no agreement: on the global set (the one with a notice board: only its
    ranks join) while no rank is joined, on CPU tensors (a host held up behind NCCL work could not answer a joining
    rank). All of it is the same on every rank."""
    return operations.board is not None and not join.someone_joined and signature.device == "cpu"


def refused_while_joined(kind: str) -> str | None:
    """Horovod's refusal of an operation that a rank in join() cannot serve; None for those it serves."""
    return None if kind in JOIN_SERVABLE else f"{kind.capitalize()} is not supported with Join at this time."


def serve_with_zeros(group: Any, signature: Signature) -> None:
    """A rank in join() takes part in an allreduce the others agreed on: zeros, of the agreed dtypes and shapes."""
    zeros = [
        torch.zeros(tensor.shape, dtype=getattr(torch, tensor.dtype), device=torch.device(signature.device))
        for tensor in signature.tensors
    ]
    if signature.kind == "optimizer":
        if zeros:
            mark_joined(zeros[0])
        for buffer in zeros:
            run_collective(lambda b=buffer: dist.all_reduce(b, group=group, async_op=True), waits_on_stream(buffer))
        return
    if signature.kind == "barrier":
        run_collective(lambda: dist.all_reduce(torch.zeros(1), group=group, async_op=True))
        return
    grouped_reduce_started(zeros, Sum if signature.op == Average else signature.op, 1.0, 1.0, group).wait()


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


@dataclass(eq=False)
class Operations:
    """The operations of one process set this rank takes part in (cycles and unannounced steps, numbered alike on
    every rank), and on the global set (the one with a notice `board`) the answers to the ranks that join right
    before one this rank waits in."""

    board: NoticeBoard | None = None
    count: int = 0
    waiting_in: dict[int, str] = field(default_factory=dict)
    unanswered: Unanswered = field(default_factory=Unanswered)
    notices_read_at: float = 0.0

    def begin(self, what: str) -> int:
        """Number the next operation; until it ends, a rank that joins right before it is answered `what`."""
        self.count += 1
        self.waiting_in[self.count] = what
        return self.count

    def end(self, operation: int) -> None:
        self.waiting_in.pop(operation, None)

    def step_to_serve(self, rank: int, size: int) -> str | None:
        """This rank (`rank` of `size`) joined: on the global set, ask the others what their next operation is. The
        name of a step they started unannounced, counted as taken part in (the caller serves it with zeros); None
        for a cycle (the join loop's cycles pair with it), when all ranks joined after the same operation, or on
        another set (no rank joins one: nothing to ask)."""
        if self.board is None:
            return None
        what = self.board.await_answer(Notice(rank, self.count), size)
        if what is None or not what.startswith(STEP):
            return None
        self.count += 1
        return what.removeprefix(STEP)

    def answer_joiners(self) -> None:
        """While this rank waits in an operation: answer the ranks that joined right before it, from the notices
        the board last fetched, and ask for a fresh fetch (at most every NOTICE_POLL seconds: every rank of a
        large job may be waiting at once). Nothing here waits for the store."""
        now = time.monotonic()
        if self.waiting_in and self.board is not None and now - self.notices_read_at >= NOTICE_POLL:
            self.notices_read_at = now
            for operation, what in self.unanswered.answers(self.board.notices, self.waiting_in).items():
                self.board.answer(operation, what)
            self.board.refresh()

    def close(self) -> None:
        """The round (or the set's group) ended: so does its notice board's thread."""
        if self.board is not None:
            self.board.close()


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
            if timed_out(deadline):
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
