"""Every rank agrees on every collective before its data moves: Horovod's coordinator semantics, with no coordinator.

An operation is submitted as a `Request`: its name (Horovod's `name=`, or an
automatic one: the n-th unnamed operation still pending), and its `Signature`
(libworker.signatures). Nothing is sent at submit. A rank that waits for a
request runs negotiation *cycles* until it is decided; a cycle is a
collective over the process set, so the cycles of all ranks pair up, and
every rank takes the same decisions from the same exchanged data:

- **Fast path (cached).** Each name agreed before keeps a cache slot (the same
  slot on every rank: slots are given out by the decisions). A cycle is one
  small allreduce (MIN) of a header and one flag per slot: the operations
  pending on every rank are the slots still set. When every pending
  operation of every rank is in the cache, that one allreduce is the whole
  negotiation, for any number of pending operations.
- **Full path.** When any rank has an operation the cache does not hold (or
  holds with another signature), the ranks exchange their pending lists
  (an allgather). An operation pending on every rank whose signatures agree
  is launched and cached; one whose signatures differ fails on every rank
  with CollectiveMismatchError naming the field and what each rank had, and
  nothing of it moves, so the next operation works.

Operations are launched in the order of the decision, identical everywhere,
so collectives pair up on the data path even when ranks submitted them in
different orders (names match them, as in Horovod). A rank in `join()` keeps
cycling with the others: it serves their agreed allreduces with zeros
(`serve`) until every rank has joined, and all return the rank that joined
last. A request that no other rank submits stalls: after the collective
timeout its wait raises CollectiveMismatchError naming the ranks that lack it.
The cache holds at most CACHE_CAPACITY names (cleared whole when full, the
same cycle everywhere) and lives for one round.

**Unannounced steps.** Once its layout is cached, a DistributedOptimizer
step on the global set whose data can count joined ranks starts its buckets
with no cycle while no rank is joined (`start_unannounced`). Cycles and such
steps are numbered alike, so a rank that calls `join()` asks the others
through the round's store what its next operation is (libworker.join_notices)
and serves a step with zeros, marking its first bucket: every rank learns of
the join from that step's data, and agrees on every step again until all
have joined. Elsewhere a cached step's cycle is sent ahead of its data
(`send_ahead`) and confirmed when the step ends.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from libworker import torch_compat
from libworker.collectives import fail, finish, launch, run_collective
from libworker.errors import CollectiveMismatchError
from libworker.join_notices import CYCLE, STEP, Notice, NoticeBoard, Unanswered
from libworker.signatures import Signature, mismatch
from libworker.world import world

CACHE_CAPACITY = 1024
JOIN_SERVABLE = frozenset({"allreduce", "barrier", "optimizer"})
HEADER = 4  # uncached-or-stalled (negated), all joined, none joined, newest joiner (negated rank + 1)
STALL_PROBE_AFTER = 2.0
IDLE_SLEEP_MAX = 0.01
NOTICE_POLL = 0.1


def cache_enabled() -> bool:
    """ELASTIC_NEGOTIATION_CACHE=0 makes every cycle take the full path (for measuring what the cache saves)."""
    return os.environ.get("ELASTIC_NEGOTIATION_CACHE", "1") != "0"


@dataclass(eq=False)
class Request:
    """One submitted operation; `start` starts its data movement once every rank agreed, and what it returns is
    kept as `started` for the caller. (`start` must not refer back to its request: a cycle would keep a finished
    round's process group alive until the garbage collector runs.)"""

    name: str | None
    signature: Signature
    start: Callable[[], Any]
    error: BaseException | None = None
    launched: bool = False
    started: Any = None

    @property
    def decided(self) -> bool:
        return self.launched or self.error is not None


@dataclass
class SentAhead:
    """An agreement in flight ahead of the data it covers (`Controller.send_ahead`): the cycle numbered
    `operation`."""

    flags: torch.Tensor
    work: Any
    slot: int
    operation: int


@dataclass
class _Decision:
    key: str
    signature: Signature
    problem: str | None


@dataclass(eq=False)
class Controller:
    """The negotiation of one process set in one round: pending requests, the cache, join state, and on the
    global set the join notices (`board`, whose thread is the only caller of the round's store)."""

    group: Any
    global_ranks: list[int]
    serve: Callable[[Signature], None]
    pending: list[Request] = field(default_factory=list)
    cache: dict[str, tuple[int, Signature]] = field(default_factory=dict)
    cache_keys: list[str] = field(default_factory=list)
    joined: bool = False
    newly_joined: bool = False
    join_result: int | None = None
    stalled: bool = False
    missing: dict[str, list[int]] = field(default_factory=dict)
    cycles: int = 0
    ahead_flags: dict[int, torch.Tensor] = field(default_factory=dict)
    someone_joined: bool = False
    waiting_in: dict[int, str] = field(default_factory=dict)
    board: NoticeBoard | None = None
    unanswered: Unanswered = field(default_factory=Unanswered)
    notices_read_at: float = 0.0

    def submit(self, request: Request) -> Request:
        if request.name is not None and any(r.name == request.name for r in self.pending):
            raise ValueError(
                f"Requested to {request.signature.kind} a tensor with the same name as another tensor that is "
                "currently "
                f"being processed: {request.name!r}"
            )
        self.pending.append(request)
        return request

    def wait(self, request: Request) -> None:
        """Run cycles until `request` is launched or failed (its error is left on it for the caller)."""
        idle_since = time.monotonic()
        idle = 0
        while not request.decided:
            if self.cycle():
                idle, idle_since = 0, time.monotonic()
                continue
            idle += 1
            waited = time.monotonic() - idle_since
            self.stalled = waited > STALL_PROBE_AFTER
            if waited > world.timing.collective_timeout:
                self._give_up(request, waited)
            time.sleep(min(0.0005 * idle, IDLE_SLEEP_MAX))
        self.stalled = False

    def _give_up(self, request: Request, waited: float) -> None:
        key = next((k for k, r in self._keyed() if r is request), request.name or "?")
        lacking = self.missing.get(key)
        who = f"ranks {lacking} did not submit it" if lacking else "the other ranks did not submit it"
        self.pending.remove(request)
        request.error = CollectiveMismatchError(f"{request.signature.kind} {key!r} stalled for {waited:.0f}s: {who}")

    def join(self) -> int:
        """Horovod's join on this set: serve the others' allreduces until every rank joined; the last one's rank."""
        for request in list(self.pending):
            self.wait(request)
        self.joined, self.newly_joined, self.join_result = True, True, None
        idle = 0
        try:
            if self.board is not None and not self.someone_joined:
                self._serve_what_comes_next(self.board)
            while self.join_result is None:
                idle = 0 if self.cycle() else idle + 1
                if idle:
                    time.sleep(min(0.0005 * idle, IDLE_SLEEP_MAX))
        finally:
            self.joined = self.newly_joined = False
        return self.join_result

    def _serve_what_comes_next(self, board: NoticeBoard) -> None:
        """The others' next operation may be a step they started unannounced: ask them (libworker.join_notices)
        and serve it with zeros; a cycle needs nothing more (the join loop's cycles pair with it)."""
        what = board.await_answer(Notice(self._my_rank(), self.cycles), len(self.global_ranks))
        if what is not None and what.startswith(STEP):
            self.cycles += 1
            self.serve(self.cache[what.removeprefix(STEP)][1])
            self.someone_joined = True

    def start_unannounced(self, name: str, signature: Signature) -> int | None:
        """Number the step `name` and let its data start with no agreement: on the global set (the one with a
        notice board: only its ranks join) while no rank is joined, on CPU tensors (a host held up behind NCCL
        work could not answer a joining rank), once its signature is cached. All of it is the same on every rank.
        A rank that joins meanwhile asks what to serve; the step's data tells every rank (`end_unannounced`).
        None: agree on it as on any operation."""
        if (
            self.board is None
            or self.someone_joined
            or signature.device != "cpu"
            or self._cached_slot(name, signature) is None
        ):
            return None
        self.cycles += 1
        self.waiting_in[self.cycles] = STEP + name
        return self.cycles

    def end_unannounced(self, operation: int, joined_ranks: torch.Tensor | None) -> None:
        """The unannounced step number `operation` ended; `joined_ranks` (its first bucket's control element, None
        if it failed) counts the ranks that served it as joined."""
        self.waiting_in.pop(operation, None)
        if joined_ranks is not None and float(joined_ranks) > 0:
            self.someone_joined = True

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

    def send_ahead(self, name: str, signature: Signature) -> SentAhead | None:
        """Start the cycle that agrees on the operation `name` without waiting for it, so its data can be launched
        right behind it: only when it would be the only pending operation and its signature is cached, as a
        training step's is from its second step in a round. The cycle is the same one small allreduce the others
        run (a rank in join() learns from it to serve the data with zeros). None: agree the usual way."""
        slot = self._cached_slot(name, signature)
        if self.pending or slot is None or self.joined or self.stalled:
            return None
        self.cycles += 1
        flags = self._ahead_flags(slot).clone()
        work = launch(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        self.waiting_in[self.cycles] = CYCLE  # until confirmed: a rank that joins meanwhile is told to cycle
        return SentAhead(flags, work, slot, self.cycles)

    def _cached_slot(self, name: str, signature: Signature) -> int | None:
        """The cache slot of `name` if it was agreed with this very signature (and the cache is on), else None."""
        hit = self.cache.get(name)
        if hit is None or (hit[1] is not signature and hit[1] != signature) or not cache_enabled():
            return None
        return hit[0]

    def _ahead_flags(self, slot: int) -> torch.Tensor:
        """The flags of a cycle in which only cache slot `slot` is pending on this rank (kept: a step sends the same
        flags every time, and building them costs more than the copy)."""
        flags = self.ahead_flags.get(slot)
        if flags is None:
            flags = self.ahead_flags[slot] = torch.zeros(HEADER + len(self.cache_keys), dtype=torch.int32)
            flags[2] = flags[HEADER + slot] = 1
        return flags

    def confirm(self, ahead: SentAhead) -> None:
        """Wait for an agreement sent ahead. Every other rank either agreed on the same request or did something
        else while this one's data was already on its way: then the round's process group cannot be trusted."""
        try:
            finish(ahead.work)
        finally:
            self.waiting_in.pop(ahead.operation, None)
        agreed = ahead.flags.tolist()
        if agreed[0] < 0 or agreed[HEADER + ahead.slot] != 1:
            raise fail(
                "the ranks did not all take the same step: this rank's data was already sent ahead of the agreement"
            )

    def _keyed(self) -> list[tuple[str, Request]]:
        """Pending requests with their keys: the name, or `noname.N` for the N-th unnamed one still pending."""
        keyed, unnamed = [], 0
        for request in self.pending:
            if request.name is None:
                keyed.append((f"noname.{unnamed}", request))
                unnamed += 1
            else:
                keyed.append((request.name, request))
        return keyed

    def _my_rank(self) -> int:
        return dist.get_rank(self.group) if self.group is not None else dist.get_rank()

    def cycle(self) -> bool:
        """One negotiation cycle with every rank of the set; True when anything was decided."""
        self.cycles += 1
        keyed = self._keyed()
        slots = [int(self.joined)] * len(self.cache_keys)
        uncached = self.stalled or not cache_enabled()
        for key, request in keyed:
            hit = self.cache.get(key)
            if hit is not None and hit[1] == request.signature:
                slots[hit[0]] = 1
            else:
                uncached = True
        header = [
            -int(uncached),
            int(self.joined),
            int(not self.joined),
            -(self._my_rank() + 1) if self.newly_joined else 0,
        ]
        flags = torch.tensor(header + slots, dtype=torch.int32)
        self.waiting_in[self.cycles] = CYCLE
        try:
            run_collective(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        finally:
            self.waiting_in.pop(self.cycles, None)
        self.newly_joined = False
        agreed = flags.tolist()
        if agreed[1] == 1:
            self.join_result = self.global_ranks[-agreed[3] - 1] if agreed[3] < 0 else self.global_ranks[-1]
            self.someone_joined = False
            return True
        any_joined = self.someone_joined = agreed[2] == 0
        if agreed[0] < 0:
            decisions = self._full_exchange(keyed)
        else:
            decisions = [
                _Decision(self.cache_keys[i], self.cache[self.cache_keys[i]][1], None)
                for i, flag in enumerate(agreed[HEADER:])
                if flag
            ]
        requests = dict(keyed)
        for decision in decisions:
            self._apply(decision, requests.get(decision.key), any_joined)
        return bool(decisions)

    def _full_exchange(self, keyed: list[tuple[str, Request]]) -> list[_Decision]:
        size = len(self.global_ranks)
        blob = msgpack.packb([self.joined, [[key, r.signature.to_wire()] for key, r in keyed]])
        length = torch.tensor([len(blob)], dtype=torch.int64)
        lengths = [torch.empty_like(length) for _ in range(size)]
        run_collective(lambda: dist.all_gather(lengths, length, group=self.group, async_op=True))
        counts = [int(n.item()) for n in lengths]
        padded = torch.zeros(max(counts), dtype=torch.uint8)
        padded[: len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        parts = [torch.empty_like(padded) for _ in range(size)]
        run_collective(lambda: dist.all_gather(parts, padded, group=self.group, async_op=True))
        lists = [msgpack.unpackb(part[:n].numpy().tobytes()) for part, n in zip(parts, counts)]
        active = [rank for rank, (joined, _) in enumerate(lists) if not joined]
        by_rank = {rank: {key: Signature.from_wire(wire) for key, wire in lists[rank][1]} for rank in active}
        self.missing = {key: [self.global_ranks[r] for r in active if key not in by_rank[r]] for key, _ in keyed}
        decisions = []
        for key, _ in lists[active[0]][1]:
            if all(key in by_rank[rank] for rank in active):
                signatures = {self.global_ranks[rank]: by_rank[rank][key] for rank in active}
                decisions.append(_Decision(key, signatures[self.global_ranks[active[0]]], mismatch(signatures)))
        return decisions

    def _apply(self, decision: _Decision, request: Request | None, any_joined: bool) -> None:
        problem = decision.problem
        if problem is None and any_joined and decision.signature.kind not in JOIN_SERVABLE:
            problem = f"{decision.signature.kind.capitalize()} is not supported with Join at this time."
        if request is not None:
            self.pending.remove(request)
        if problem is not None:
            if request is not None:
                request.error = CollectiveMismatchError(problem)
            return
        self._remember(decision.key, decision.signature)
        if request is None:
            self.serve(decision.signature)
            return
        try:
            request.started = request.start()
            request.launched = True
        except BaseException as exc:
            request.error = exc

    def _remember(self, key: str, signature: Signature) -> None:
        """Cache `key`'s agreed signature; every rank takes the same decisions, so every cache stays the same."""
        if key in self.cache:
            self.cache[key] = (self.cache[key][0], signature)
            return
        if len(self.cache_keys) >= CACHE_CAPACITY:
            self.cache.clear()
            self.cache_keys.clear()
        self.ahead_flags.clear()
        self.cache[key] = (len(self.cache_keys), signature)
        self.cache_keys.append(key)


_controllers: dict[int, Controller] = {}
_controllers_round = [0]


def controller(set_id: int, group: Any, global_ranks: list[int], serve: Callable[[Signature], None]) -> Controller:
    """The negotiation of process set `set_id` in the current round (a new round starts with empty ones)."""
    if _controllers_round[0] != world.round:
        for ended in _controllers.values():
            ended.close()
        _controllers.clear()
        _controllers_round[0] = world.round
    found = _controllers.get(set_id)
    if found is None or found.group is not group:
        if found is not None:
            found.close()
        board = NoticeBoard(torch_compat.default_store()) if set_id == 0 else None  # no rank joins another set
        found = _controllers[set_id] = Controller(group, global_ranks, serve, board=board)
    return found


def _answer_joiners() -> None:
    """A stuck hook (libworker.collectives): the global set's controller of this round answers join notices."""
    found = _controllers.get(0) if _controllers_round[0] == world.round else None
    if found is not None:
        found.answer_joiners()


world.stuck_hooks.append(_answer_joiners)
