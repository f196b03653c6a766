"""The operations behind Horovod's handles, from submission to result, and Horovod's join() on the global set.

An operation is submitted to the negotiation of its process set
(libworker.negotiation) with its signature and a launcher, and gets a handle
at once; `synchronize` / `poll` negotiate every operation queued so far,
launch the agreed ones in the order all ranks share, and wait. A mismatch
raises CollectiveMismatchError on every rank with nothing sent; a handle of
an earlier round raises WorkerInternalError. `agree` negotiates an operation
its caller runs itself (DistributedOptimizer's buckets). A rank in `join()`
takes part in the allreduces the others agreed on, with zeros
(libworker.joining).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from libworker import negotiation, process_sets
from libworker.collectives import Started
from libworker.errors import WorkerInternalError
from libworker.joining import serve_with_zeros
from libworker.negotiation import Controller, Request
from libworker.process_sets import ProcessSet, global_process_set
from libworker.signatures import Signature
from libworker.world import require_joined, world


@dataclass(eq=False)
class _Pending:
    """An operation behind a handle: its negotiation request (whose `started` is a Started once it is launched),
    and what synchronize makes of the result (`then`)."""

    request: Request
    controller: Controller
    round: int
    then: Callable[[Any], Any] = lambda result: result


_handles: dict[int, _Pending] = {}
_handle_ids = itertools.count(1)


def _negotiation(process_set: ProcessSet) -> tuple[Controller, Any]:
    require_joined()
    group = process_sets.group_of(process_set)
    ranks = process_set._ranks()
    return negotiation.controller(
        process_sets.registered_id(process_set), group, ranks, functools.partial(serve_with_zeros, group)
    ), group


def submit(process_set: ProcessSet, name: str | None, signature: Signature, start: Callable[[Any], Started]) -> int:
    """Queue an operation for negotiation; once every rank agreed, `start(group)` launches it. Returns its handle."""
    controller, group = _negotiation(process_set)
    for stale in [h for h, p in _handles.items() if p.round != world.round]:
        del _handles[stale]

    pending = _Pending(Request(name, signature, functools.partial(start, group)), controller, world.round)
    controller.submit(pending.request)
    handle = next(_handle_ids)
    _handles[handle] = pending
    return handle


def map_result(handle: int, make_result: Callable[[Any], Any]) -> int:
    """Make `synchronize(handle)` return `make_result` of the operation's result; returns the handle."""
    _handles[handle].then = make_result
    return handle


def _nothing_to_confirm() -> None:
    """The step's agreement was reached before its data started, or it needs none."""


def _no_joined_ranks_to_count(joined_ranks: torch.Tensor | None) -> None:
    """Only a step started unannounced learns from its data that ranks joined (cycles tell the others)."""


def _no_joiners_to_answer() -> None:
    """A rank that joins before a cycle learns from the cycle what to serve."""


@dataclass(frozen=True)
class StepAgreement:
    """How one operation its caller runs itself (DistributedOptimizer's step) was agreed on: `confirm` waits for
    an agreement sent ahead of the data (WorkerInternalError if the ranks turn out not to agree); `while_stuck`
    runs while the caller waits for the step's data (a step started unannounced answers the ranks that join right
    before it); `end` takes the step's count of ranks that served it as joined (a one-element tensor from its data;
    None if it failed)."""

    confirm: Callable[[], None] = _nothing_to_confirm
    while_stuck: Callable[[], None] = _no_joiners_to_answer
    end: Callable[[torch.Tensor | None], None] = _no_joined_ranks_to_count


def agree(process_set: ProcessSet, name: str, signature: Signature, *, may_start_unannounced: bool) -> StepAgreement:
    """Agree on an operation the caller then runs itself (DistributedOptimizer's buckets), before it starts it.

    If the caller's data tells its ranks that one joined (`may_start_unannounced`), once the signature is cached,
    on the global set while no rank is joined, the step starts unannounced (Controller.start_unannounced: nothing
    is sent; a rank that joins meanwhile asks what to serve). Otherwise, once cached, the agreement is sent ahead
    (Controller.send_ahead) and the caller starts its data at once. Otherwise it agrees now, raising what a
    mismatch raises."""
    controller, _ = _negotiation(process_set)
    operation = controller.start_unannounced(name, signature) if may_start_unannounced else None
    if operation is not None:
        return StepAgreement(
            while_stuck=controller.operations.answer_joiners,
            end=functools.partial(controller.end_unannounced, operation),
        )
    ahead = controller.send_ahead(name, signature)
    if ahead is not None:
        return StepAgreement(confirm=functools.partial(controller.confirm, ahead))
    synchronize(submit(process_set, name, signature, lambda group: Started([], lambda: None)))
    return StepAgreement()


def poll(handle: int) -> bool:
    """True when the operation behind `handle` has completed (synchronize will not block). An operation still
    being negotiated takes one negotiation cycle here."""
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"unknown handle {handle!r}")
    if pending.round != world.round:
        return True
    if not pending.request.decided:
        pending.controller.cycle()
    if not pending.request.decided:
        return False
    return pending.request.error is not None or all(work.is_completed() for work in pending.request.started.works)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind `handle` and return its result (None for an unknown handle, as Horovod)."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    if pending.round != world.round:
        raise WorkerInternalError(
            f"handle {handle} belongs to round {pending.round}; the job has re-formed since (round {world.round})"
        )
    if not pending.request.decided:
        pending.controller.wait(pending.request)
    if pending.request.error is not None:
        raise pending.request.error
    started: Started = pending.request.started
    started.wait()
    return pending.then(started.result())


def join(device: int = -1) -> int:
    """A rank that ran out of data calls join(): until every rank has joined it takes part in the others'
    allreduces (with zeros; DistributedOptimizer's steps included), and allgather, broadcast, alltoall or
    reducescatter on the other ranks fail meanwhile (as in Horovod). Returns the rank that joined last."""
    controller, _ = _negotiation(global_process_set)
    return controller.join()
