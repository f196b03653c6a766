"""Every rank agrees on every collective before its data moves: Horovod's coordinator semantics, with no coordinator.

An operation is submitted as a `Request`: its name (Horovod's `name=`, or an
automatic one: the n-th unnamed operation still pending), and its `Signature`
(libworker.signatures). Nothing is sent at submit. A rank that waits for a
request runs negotiation *cycles* until it is decided; a cycle is a
collective over the process set, so the cycles of all ranks pair up, and
every rank takes the same decisions from the same exchanged data:

- **Fast path (cached).** Each name agreed before keeps a position in the
  response cache (libworker.response_cache), the same on every rank. A cycle
  is one small allreduce (MIN) of a header (`CycleHeader`) and one flag per
  position: the operations pending on every rank are the positions still
  set. When every pending operation of every rank is in the cache, that one
  allreduce is the whole negotiation, for any number of pending operations.
- **Full path.** When any rank has an operation the cache does not hold (or
  holds with another signature), the ranks exchange their pending lists
  (an allgather). An operation pending on every rank whose signatures agree
  is launched and cached; one whose signatures differ fails on every rank
  with CollectiveMismatchError naming the field and what each rank had, and
  nothing of it moves, so the next operation works.

Operations are launched in the order of the decision, identical everywhere,
so collectives pair up on the data path even when ranks submitted them in
different orders (names match them, as in Horovod). A request that no other
rank submits stalls: after the collective timeout its wait raises
CollectiveMismatchError naming the ranks that lack it. A rank in Horovod's
`join()` keeps cycling with the others (libworker.joining: the protocol). A
cached DistributedOptimizer step whose data counts joined ranks starts with
no cycle while no rank is joined (`start_unannounced`); elsewhere a cached
step's cycle is sent ahead of its data (`send_ahead`) and confirmed when the
step ends.
"""

from __future__ import annotations

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
from libworker.joining import (
    CYCLE,
    STEP,
    JoinState,
    NoticeBoard,
    Operations,
    may_start_unannounced,
    refused_while_joined,
)
from libworker.response_cache import ResponseCache, cache_enabled
from libworker.signatures import Signature, mismatch
from libworker.world import world

STALL_PROBE_AFTER = 2.0
IDLE_SLEEP_MAX = 0.01


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


@dataclass(frozen=True)
class CycleHeader:
    """What a cycle tells every rank besides the cached operations: the first FIELDS flags of its MIN-allreduce.

    Each rank sends its own view; each field is encoded so that the minimum
    over the ranks is what every rank needs: a condition as 1 or 0 (the
    minimum: it holds on every rank), and the newest joiner as minus its rank
    plus one, 0 on a rank that did not join in this cycle (the minimum: the
    highest rank that did)."""

    all_cached: bool
    all_joined: bool
    none_joined: bool
    newest_joiner: int | None = None

    FIELDS = 4

    def encode(self) -> list[int]:
        joiner = 0 if self.newest_joiner is None else -(self.newest_joiner + 1)
        return [int(self.all_cached), int(self.all_joined), int(self.none_joined), joiner]

    @classmethod
    def decode(cls, agreed: list[int]) -> CycleHeader:
        cached, joined, none_joined, joiner = agreed[: cls.FIELDS]
        return cls(cached == 1, joined == 1, none_joined == 1, -joiner - 1 if joiner < 0 else None)


AHEAD_HEADER = CycleHeader(all_cached=True, all_joined=False, none_joined=True).encode()


class AheadFlags:
    """The flags of a cycle in which only one cached operation is pending on this rank, kept per cache position (a
    step sends the same flags every time, and building them costs more than the copy) while the cache's size
    stays."""

    def __init__(self) -> None:
        self._kept: dict[int, torch.Tensor] = {}
        self._cache_size = 0

    def of(self, position: int, cache_size: int) -> torch.Tensor:
        if cache_size != self._cache_size:
            self._kept, self._cache_size = {}, cache_size
        flags = self._kept.get(position)
        if flags is None:
            flags = self._kept[position] = torch.zeros(CycleHeader.FIELDS + cache_size, dtype=torch.int32)
            flags[: CycleHeader.FIELDS] = torch.tensor(AHEAD_HEADER, dtype=torch.int32)
            flags[CycleHeader.FIELDS + position] = 1
        return flags


@dataclass
class SentAhead:
    """An agreement in flight ahead of the data it covers (`Controller.send_ahead`): operation number `operation`,
    the cycle that agrees on the cached operation at `position`."""

    flags: torch.Tensor
    work: Any
    position: int
    operation: int


@dataclass
class _Decision:
    key: str
    signature: Signature
    problem: str | None


@dataclass(eq=False)
class Controller:
    """The negotiation of one process set in one round: its pending requests, its response cache, Horovod's join on
    it (`join`), and its operations (`operations`; on the global set with the notice board)."""

    group: Any
    global_ranks: list[int]
    serve: Callable[[Signature], None]
    operations: Operations = field(default_factory=Operations)
    pending: list[Request] = field(default_factory=list)
    stalled: bool = False
    missing: dict[str, list[int]] = field(default_factory=dict)
    cache: ResponseCache = field(default_factory=ResponseCache)
    ahead_flags: AheadFlags = field(default_factory=AheadFlags)
    join_state: JoinState = field(default_factory=JoinState)

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
        with world.waits.waiting():
            while not request.decided:
                if self.cycle():
                    idle, idle_since = 0, time.monotonic()
                    continue
                idle += 1
                waited = time.monotonic() - idle_since
                self.stalled = waited > STALL_PROBE_AFTER
                if waited > world.timing.collective_timeout and not world.waits.excused():
                    self._give_up(request, waited)
                time.sleep(min(0.0005 * idle, IDLE_SLEEP_MAX))
        self.stalled = False

    def _give_up(self, request: Request, waited: float) -> None:
        key = next((k for k, r in self._keyed() if r is request), request.name or "?")
        lacking = self.missing.get(key)
        who = f"ranks {lacking} did not submit it" if lacking else "the other ranks did not submit it"
        self.pending.remove(request)
        world.waits.discount()
        request.error = CollectiveMismatchError(f"{request.signature.kind} {key!r} stalled for {waited:.0f}s: {who}")

    def join(self) -> int:
        """Horovod's join on this set: serve the others' allreduces until every rank joined; the last one's rank."""
        for request in list(self.pending):
            self.wait(request)
        self.join_state.enter()
        idle = 0
        try:
            with world.waits.waiting(calibrates=False):
                if not self.join_state.someone_joined:
                    self._serve_what_comes_next()
                while self.join_state.last_joiner is None:
                    idle = 0 if self.cycle() else idle + 1
                    if idle:
                        time.sleep(min(0.0005 * idle, IDLE_SLEEP_MAX))
        finally:
            self.join_state.leave()
        return self.join_state.last_joiner

    def _serve_what_comes_next(self) -> None:
        """The others' next operation may be a step they started unannounced: serve it with zeros; a cycle needs
        nothing more (the join loop's cycles pair with it)."""
        step = self.operations.step_to_serve(self._my_rank(), len(self.global_ranks))
        if step is not None:
            self.serve(self.cache.signature_of(step))
            self.join_state.someone_joined = True

    def start_unannounced(self, name: str, signature: Signature) -> int | None:
        """Number the step `name` and let its data start with no agreement where libworker.joining allows it, once
        its signature is cached. A rank that joins meanwhile asks what to serve; the step's data tells every rank
        (`end_unannounced`). None: agree on it as on any operation."""
        if not may_start_unannounced(self.operations, self.join_state, signature):
            return None
        if self._cached_position(name, signature) is None:
            return None
        return self.operations.begin(STEP + name)

    def end_unannounced(self, operation: int, joined_ranks: torch.Tensor | None) -> None:
        """The unannounced step number `operation` ended; `joined_ranks` (its first bucket's control element, None
        if it failed) counts the ranks that served it as joined."""
        self.operations.end(operation)
        self.join_state.count_step(joined_ranks)

    def send_ahead(self, name: str, signature: Signature) -> SentAhead | None:
        """Start the cycle that agrees on the operation `name` without waiting for it, so its data can be launched
        right behind it: only when it would be the only pending operation and its signature is cached, as a
        training step's is from its second step in a round. The cycle is the same one small allreduce the others
        run (a rank in join() learns from it to serve the data with zeros). None: agree the usual way."""
        position = self._cached_position(name, signature)
        if self.pending or position is None or self.join_state.joined or self.stalled:
            return None
        flags = self.ahead_flags.of(position, len(self.cache)).clone()
        work = launch(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group, async_op=True))
        operation = self.operations.begin(CYCLE)  # until confirmed: a rank that joins meanwhile is told to cycle
        return SentAhead(flags, work, position, operation)

    def confirm(self, ahead: SentAhead) -> None:
        """Wait for an agreement sent ahead. Every other rank either agreed on the same request or did something
        else while this one's data was already on its way: then the round's process group cannot be trusted."""
        try:
            finish(ahead.work, while_stuck=self.operations.answer_joiners)
        finally:
            self.operations.end(ahead.operation)
        agreed = ahead.flags.tolist()
        if not CycleHeader.decode(agreed).all_cached or agreed[CycleHeader.FIELDS + ahead.position] != 1:
            raise fail(
                "the ranks did not all take the same step: this rank's data was already sent ahead of the agreement"
            )

    def _cached_position(self, name: str, signature: Signature) -> int | None:
        """The cache position of `name` if it was agreed with this very signature and the cache is on, else None."""
        return self.cache.position_of(name, signature) if cache_enabled() else None

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
        keyed = self._keyed()
        joined = self.join_state.joined
        positions = [int(joined)] * len(self.cache)
        all_cached = not self.stalled and cache_enabled()
        for key, request in keyed:
            position = self.cache.position_of(key, request.signature)
            if position is None:
                all_cached = False
            else:
                positions[position] = 1
        mine = CycleHeader(all_cached, joined, not joined, self._my_rank() if self.join_state.newly_joined else None)
        flags = torch.tensor(mine.encode() + positions, dtype=torch.int32)
        operation = self.operations.begin(CYCLE)
        try:
            run_collective(
                lambda: dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=self.group, async_op=True),
                while_stuck=self.operations.answer_joiners,
            )
        finally:
            self.operations.end(operation)
        self.join_state.newly_joined = False
        agreed = flags.tolist()
        header = CycleHeader.decode(agreed)
        if header.all_joined:
            last = header.newest_joiner
            self.join_state.all_joined(self.global_ranks[last if last is not None else -1])
            return True
        self.join_state.someone_joined = not header.none_joined
        if header.all_cached:
            decisions = [
                _Decision(*self.cache.at(position), None)
                for position, flag in enumerate(agreed[CycleHeader.FIELDS :])
                if flag
            ]
        else:
            decisions = self._full_exchange(keyed)
        requests = dict(keyed)
        for decision in decisions:
            self._apply(decision, requests.get(decision.key), self.join_state.someone_joined)
        return bool(decisions)

    def _full_exchange(self, keyed: list[tuple[str, Request]]) -> list[_Decision]:
        size = len(self.global_ranks)
        blob = msgpack.packb([self.join_state.joined, [[key, r.signature.to_wire()] for key, r in keyed]])
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
        if problem is None and any_joined:
            problem = refused_while_joined(decision.signature.kind)
        if request is not None:
            self.pending.remove(request)
        if problem is not None:
            if request is not None:
                request.error = CollectiveMismatchError(problem)
            return
        self.cache.remember(decision.key, decision.signature)
        if request is None:
            self.serve(decision.signature)
            return
        try:
            request.started = request.start()
            request.launched = True
        except BaseException as exc:
            request.error = exc

    def close(self) -> None:
        """The round (or the set's group) ended: so does its notice board's thread."""
        self.operations.close()


_controllers: dict[int, Controller] = {}
_controllers_round = [0]


def controller(set_id: int, group: Any, global_ranks: list[int], serve: Callable[[Signature], None]) -> Controller:
    """The negotiation of process set `set_id` in the current round (a new round starts with empty ones); the global
    set's keeps the round's join notices (no rank joins another set)."""
    if _controllers_round[0] != world.round:
        for ended in _controllers.values():
            ended.close()
        _controllers.clear()
        _controllers_round[0] = world.round
    found = _controllers.get(set_id)
    if found is None or found.group is not group:
        if found is not None:
            found.close()
        board = NoticeBoard(torch_compat.default_store()) if set_id == 0 else None
        found = _controllers[set_id] = Controller(group, global_ranks, serve, Operations(board))
    return found
