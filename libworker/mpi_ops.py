"""Horovod's torch collectives (`horovod.torch.mpi_ops`) over the round's process group, through the abortable core.

Same names, arguments and results as Horovod: reduce ops as constants
(`Average`, `Sum`, `Adasum`, `Min`, `Max`, `Product`; the strings "mean",
"sum", ... still work), `name=`, `prescale_factor`/`postscale_factor`,
`compression=`, `process_set=`, and the deprecated `average=`.

Every operation is submitted to the negotiation of its process set
(libworker.negotiation) with its signature and a launcher; the `_async` forms
return a handle at once, and `synchronize` / `poll` negotiate every operation
queued so far, launch the agreed ones in the order all ranks share, and wait.
A mismatch raises CollectiveMismatchError on every rank with nothing sent.
Launchers move data through libworker.wire, which makes every dtype exact on
gloo. The out-of-place forms are differentiable, as Horovod's (autograd
Functions at the end). A dead peer or an abort of the round makes any of
them raise WorkerInternalError (Horovod's HorovodInternalError); a handle of
an earlier round raises it too.
"""

from __future__ import annotations

import functools
import itertools
import operator
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from libworker import adasum, negotiation, process_sets, wire
from libworker.collectives import finish, launch, run_collective, waits_on_stream
from libworker.compression import Compression, Compressor
from libworker.errors import CollectiveMismatchError, WorkerInternalError
from libworker.negotiation import Controller, Request, Signature, spec_of
from libworker.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from libworker.world import require_joined, world

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {"mean": Average, "average": Average, "sum": Sum, "adasum": Adasum, "min": Min, "max": Max, "product": Product}
TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


def reduce_op(op: Any, average: Any = None) -> int:
    """Horovod's op resolution: `op` wins, the deprecated `average=` maps to Average/Sum, default Average.
    Strings name ops too; a string in `average`'s place is an op given positionally (libworker's own form)."""
    if isinstance(average, str):
        op, average = average, None
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op`", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if isinstance(op, str):
        if op.lower() not in OP_NAMES:
            raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(OP_NAMES)}")
        return OP_NAMES[op.lower()]
    if op not in (Average, Sum, Adasum, Min, Max, Product):
        raise ValueError(f"unknown reduce op {op!r}; use hvd.Average, Sum, Adasum, Min, Max or Product")
    return int(op)


def _check_root(root_rank: int, process_set: ProcessSet) -> None:
    size = int(require_joined()["size"])
    if not 0 <= int(root_rank) < size:
        raise ValueError(f"root_rank {root_rank} is not a rank of this round (size {size})")
    if process_set.process_set_id not in (0, None) and int(root_rank) not in process_set.ranks:
        raise ValueError(f"root_rank {root_rank} is not a member of {process_set}")


@dataclass(eq=False)
class _Pending:
    """An operation behind a handle: its negotiation request (whose `started` is a _Started once it is launched),
    and what synchronize makes of the result (`then`)."""

    request: Request
    controller: Controller
    round: int
    then: Callable[[Any], Any] = lambda result: result


@dataclass(frozen=True)
class _Started:
    """What a launcher started: works to wait for, and how to make the result once they are done."""

    works: list[Any]
    result: Callable[[], Any]
    on_stream: bool = False


_handles: dict[int, _Pending] = {}
_handle_ids = itertools.count(1)


def _negotiation(process_set: ProcessSet) -> tuple[Controller, Any]:
    require_joined()
    group = process_sets.group_of(process_set)
    ranks = process_set._ranks()
    return negotiation.controller(process_sets.registered_id(process_set), group, ranks, functools.partial(_serve, group)), group


def _submit(process_set: ProcessSet, name: str | None, signature: Signature, start: Callable[[Any], _Started]) -> int:
    """Queue an operation for negotiation; once every rank agreed, `start(group)` launches it. Returns its handle."""
    controller, group = _negotiation(process_set)
    for stale in [h for h, p in _handles.items() if p.round != world.round]:
        del _handles[stale]

    pending = _Pending(Request(name, signature, functools.partial(start, group)), controller, world.round)
    controller.submit(pending.request)
    handle = next(_handle_ids)
    _handles[handle] = pending
    return handle


def agree(process_set: ProcessSet, name: str, signature: Signature) -> Callable[[], None]:
    """Agree on an operation the caller then runs itself (DistributedOptimizer's buckets), before it starts it.

    Once the signature is cached the agreement is sent ahead (Controller.send_ahead) and the caller starts its
    data at once; the returned function waits for the agreement (WorkerInternalError if the ranks turn out not
    to agree). Otherwise it agrees now, raising what a mismatch raises, and returns a function with nothing to
    wait for."""
    controller, _ = _negotiation(process_set)
    ahead = controller.send_ahead(Request(name, signature, lambda: None))
    if ahead is not None:
        return functools.partial(controller.confirm, ahead)
    synchronize(_submit(process_set, name, signature, lambda group: _Started([], lambda: None)))
    return lambda: None


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
        raise WorkerInternalError(f"handle {handle} belongs to round {pending.round}; the job has re-formed since (round {world.round})")
    if not pending.request.decided:
        pending.controller.wait(pending.request)
    if pending.request.error is not None:
        raise pending.request.error
    started: _Started = pending.request.started
    for work in started.works:
        finish(work, started.on_stream)
    return pending.then(started.result())


def _group_size(group: Any) -> int:
    return dist.get_world_size(group)


def _reduce_started(tensors: list[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float, group: Any) -> _Started:
    """Reduce tensors in place as one operation; the result is the list of tensors."""
    if op == Adasum:
        for tensor in tensors:
            wire.scale_(tensor, prescale_factor)
        adasum.adasum_(tensors, group)
        for tensor in tensors:
            wire.scale_(tensor, postscale_factor)
        return _Started([], lambda: tensors)
    size = _group_size(group)
    works, sent = [], []
    for tensor in tensors:
        wire.scale_(tensor, prescale_factor)
        reduced = wire.reducible(tensor)
        torch_op = wire.BOOL_OPS[_OP_WORDS[op]] if tensor.dtype == torch.bool else TORCH_OPS[op]
        works.append(launch(lambda t=reduced, o=torch_op: dist.all_reduce(t, op=o, group=group, async_op=True)))
        sent.append(reduced)

    def result() -> list[torch.Tensor]:
        for tensor, reduced in zip(tensors, sent):
            wire.narrow(tensor, reduced)
            if op == Average:
                wire.average_(tensor, size)
            wire.scale_(tensor, postscale_factor)
        return tensors

    return _Started(works, result, any(waits_on_stream(t) for t in tensors))


_OP_WORDS = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product"}


def _fused(tensors: list[torch.Tensor]) -> tuple[dict[tuple[torch.dtype, torch.device], list[int]], list[torch.Tensor]]:
    """Indices of `tensors` per (dtype, device) in order of first appearance, and one flat buffer per group."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    return groups, [torch.cat([tensors[i].reshape(-1) for i in members]) for members in groups.values()]


def _grouped_reduce_started(tensors: list[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float, group: Any) -> _Started:
    """One fused buffer per dtype and device, reduced as one operation; results copied back into `tensors`.
    Adasum takes the tensors as they are: its coefficients are per tensor."""
    if op == Adasum or len(tensors) == 1:
        return _reduce_started(tensors, op, prescale_factor, postscale_factor, group)
    groups, buffers = _fused(tensors)
    started = _reduce_started(buffers, op, prescale_factor, postscale_factor, group)

    def result() -> list[torch.Tensor]:
        started.result()
        for members, buffer in zip(groups.values(), buffers):
            for index, part in zip(members, buffer.split([tensors[i].numel() for i in members])):
                tensors[index].copy_(part.view_as(tensors[index]))
        return tensors

    return _Started(started.works, result, started.on_stream)


def _serve(group: Any, signature: Signature) -> None:
    """A rank in join() takes part in an allreduce the others agreed on: zeros, of the agreed dtypes and shapes."""
    zeros = [torch.zeros(spec.shape, dtype=getattr(torch, spec.dtype), device=torch.device(signature.device)) for spec in signature.tensors]
    if signature.kind == "optimizer":
        for buffer in zeros:
            run_collective(lambda b=buffer: dist.all_reduce(b, group=group, async_op=True), waits_on_stream(buffer))
        return
    if signature.kind == "barrier":
        run_collective(lambda: dist.all_reduce(torch.zeros(1), group=group, async_op=True))
        return
    started = _grouped_reduce_started(zeros, Sum if signature.op == Average else signature.op, 1.0, 1.0, group)
    for work in started.works:
        finish(work, started.on_stream)


def _reduce_signature(tensors: list[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float) -> Signature:
    return Signature("allreduce", tuple(spec_of(t) for t in tensors), op, -1, float(prescale_factor), float(postscale_factor),
                     _device_label(tensors))


def _device_label(tensors: list[torch.Tensor]) -> str:
    return "cuda" if tensors and tensors[0].is_cuda else "cpu"


def _check_reducible(tensors: list[torch.Tensor], op: int) -> None:
    if any(t.dtype == torch.bool for t in tensors) and op in (Average, Adasum):
        raise ValueError("bool tensors reduce with Sum or Max (logical or) and Min or Product (logical and), not Average or Adasum")


def allreduce_async_(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing `tensor` in place; `synchronize(handle)` returns it reduced."""
    resolved = reduce_op(op, average)
    _check_reducible([tensor], resolved)
    signature = _reduce_signature([tensor], resolved, prescale_factor, postscale_factor)

    def start(group: Any) -> _Started:
        started = _reduce_started([tensor], resolved, prescale_factor, postscale_factor, group)
        return _Started(started.works, lambda: started.result()[0], started.on_stream)

    return _submit(process_set, name, signature, start)


def allreduce_(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` in place across all ranks (default op: Average, as Horovod) and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    return allreduce_async_(tensor.clone(), average, name, op, prescale_factor, postscale_factor, process_set)


def _allreduce(tensor: torch.Tensor, average: Any = None, name: str | None = None, compression: type[Compressor] = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of `tensor` across all ranks, as a new tensor; `tensor` is left as it is."""
    compressed, ctx = compression.compress(tensor)
    reduced = allreduce_(compressed.clone() if compressed is tensor else compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _grouped_async_(tensors: list[torch.Tensor], average: Any, name: str | None, op: Any, prescale_factor: float,
                    postscale_factor: float, process_set: ProcessSet) -> int:
    resolved = reduce_op(op, average)
    _check_reducible(tensors, resolved)
    signature = _reduce_signature(tensors, resolved, prescale_factor, postscale_factor)
    return _submit(process_set, name, signature, lambda group: _grouped_reduce_started(tensors, resolved, prescale_factor, postscale_factor, group))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    return _grouped_async_(list(tensors), average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    return _grouped_async_([t.clone() for t in tensors], average, name, op, prescale_factor, postscale_factor, process_set)


def _grouped_allreduce(tensors: list[torch.Tensor], average: Any = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    compressed = [compression.compress(t) for t in tensors]
    sent = [c.clone() if c is t else c for (c, _), t in zip(compressed, tensors)]
    reduced = grouped_allreduce_(sent, average, name, op, prescale_factor, postscale_factor, process_set)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


class _SparseHandle(int):
    """Horovod's sparse_allreduce_async returns a function to call for the result; this is also a handle."""

    def __call__(self) -> torch.Tensor:
        return synchronize(self)


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = None, process_set: ProcessSet = global_process_set) -> _SparseHandle:
    """A sparse tensor, reduced densely; call the result (or synchronize it) for the reduced sparse tensor."""
    handle = allreduce_async_(tensor.to_dense(), name=name, op=op, process_set=process_set)
    _handles[handle].then = torch.Tensor.to_sparse
    return _SparseHandle(handle)


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    _check_root(root_rank, process_set)
    signature = Signature("broadcast", (spec_of(tensor),), root=int(root_rank), device=_device_label([tensor]))

    def start(group: Any) -> _Started:
        dense = tensor if tensor.is_contiguous() else tensor.contiguous()
        sent = dense.reshape(-1).view(torch.uint8) if wire.moves_as_bytes(dense) else dense
        work = launch(lambda: dist.broadcast(sent, src=int(root_rank), group=group, async_op=True))

        def result() -> torch.Tensor:
            if dense is not tensor:
                tensor.copy_(dense)
            return tensor

        return _Started([work], result, waits_on_stream(tensor))

    return _submit(process_set, name, signature, start)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with root_rank's value, in place."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    return broadcast_async_(tensor.clone(), root_rank, name, process_set)


def _broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """root_rank's value of `tensor`, as a new tensor."""
    return broadcast_(tensor.clone(), root_rank, name, process_set)


def _gather_started(tensor: torch.Tensor, group: Any) -> _Started:
    """Every rank's tensor concatenated along dim 0, in rank order; first dimensions may differ."""
    size, rank = _group_size(group), dist.get_rank(group)
    lengths = torch.zeros(size, dtype=torch.int64, device=tensor.device)
    lengths[rank] = tensor.shape[0]
    run_collective(lambda: dist.all_reduce(lengths, group=group, async_op=True), waits_on_stream(lengths))
    counts = lengths.tolist()
    padded = torch.zeros((max(counts), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    as_bytes = wire.moves_as_bytes(tensor)
    sent = wire.as_rows_of_bytes(padded) if as_bytes else padded
    parts = [torch.empty_like(sent) for _ in range(size)]
    work = launch(lambda: dist.all_gather(parts, sent, group=group, async_op=True))

    def result() -> torch.Tensor:
        rows = [wire.from_rows_of_bytes(p, tensor.dtype, tuple(tensor.shape[1:])) if as_bytes else p for p in parts]
        return torch.cat([part[:n] for part, n in zip(rows, counts)])

    return _Started([work], result, waits_on_stream(padded))


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.dim() > 0 else tensor.reshape(1)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    tensor = _gathered(tensor)
    signature = Signature("allgather", (spec_of(tensor, skip_first=True),), device=_device_label([tensor]))
    return _submit(process_set, name, signature, lambda group: _gather_started(tensor, group))


def _allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ, as in Horovod)."""
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    tensors = [_gathered(t) for t in tensors]
    signature = Signature("allgather", tuple(spec_of(t, skip_first=True) for t in tensors), device=_device_label(tensors))

    def start(group: Any) -> _Started:
        started = [_gather_started(t, group) for t in tensors]
        return _Started([w for s in started for w in s.works], lambda: [s.result() for s in started], any(s.on_stream for s in started))

    return _submit(process_set, name, signature, start)


def _grouped_allgather(tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def _splits(tensor: torch.Tensor, splits: Any, size: int) -> list[int]:
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by the size ({tensor.shape[0]} rows, {size} ranks)")
        return [tensor.shape[0] // size] * size
    if isinstance(splits, torch.Tensor) and splits.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"alltoall splits must be a tensor of int32 or int64, not {splits.dtype}")
    send = [int(n) for n in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(send) != size or sum(send) != tensor.shape[0] or min(send) < 0:
        raise ValueError(f"alltoall splits {send} must give one non-negative count per rank ({size}) summing to {tensor.shape[0]} rows")
    return send


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Send slice j of `tensor` (along dim 0) to rank j; the result is what every rank sent here, in rank order,
    and how many rows came from each rank."""
    require_joined()
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension")
    send = _splits(tensor, splits, len(process_set._ranks()))
    signature = Signature("alltoall", (spec_of(tensor, skip_first=True),), device=_device_label([tensor]))

    def start(group: Any) -> _Started:
        size = _group_size(group)
        sent_counts = torch.tensor(send, dtype=torch.int64)
        received_counts = torch.empty(size, dtype=torch.int64)
        run_collective(lambda: dist.all_to_all_single(received_counts, sent_counts, group=group, async_op=True))
        receive = received_counts.tolist()
        output = torch.empty((sum(receive), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        as_bytes = wire.moves_as_bytes(tensor)
        out_wire = wire.as_rows_of_bytes(output) if as_bytes else output
        in_wire = wire.as_rows_of_bytes(tensor.contiguous()) if as_bytes else tensor.contiguous()
        work = launch(lambda: dist.all_to_all_single(out_wire, in_wire, receive, send, group=group, async_op=True))
        return _Started([work], lambda: (output, received_counts), waits_on_stream(output))

    return _submit(process_set, name, signature, start)


def _alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """The gathered slices; with `splits`, also the counts received from each rank (Horovod's two results)."""
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


def _scatter_part(reduced: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    base, extra = divmod(reduced.shape[0], size)
    start = rank * base + min(rank, extra)
    return reduced[start : start + base + (1 if rank < extra else 0)].clone()


def _check_scatterable(tensors: list[torch.Tensor], op: int) -> None:
    if op == Adasum:
        raise CollectiveMismatchError("reducescatter does not support Adasum")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors of at least one dimension")
    _check_reducible(tensors, op)


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: Any = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Reduce each tensor across ranks and keep this rank's part of dim 0 (the first ranks get one more row when
    the rows do not divide evenly, as Horovod); one negotiation and one fused reduction for the group."""
    resolved = reduce_op(op)
    _check_scatterable(tensors, resolved)
    reduced = [t.clone() for t in tensors]
    signature = Signature("reducescatter", tuple(spec_of(t) for t in tensors), resolved, -1, float(prescale_factor),
                          float(postscale_factor), _device_label(tensors))

    def start(group: Any) -> _Started:
        started = _grouped_reduce_started(reduced, resolved, prescale_factor, postscale_factor, group)
        size, rank = _group_size(group), dist.get_rank(group)
        return _Started(started.works, lambda: [_scatter_part(r, size, rank) for r in started.result()], started.on_stream)

    return _submit(process_set, name, signature, start)


def _grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: type[Compressor] = Compression.none,
                          op: Any = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    compressed = [compression.compress(t) for t in tensors]
    parts = synchronize(grouped_reducescatter_async([c for c, _ in compressed], name, op, process_set, prescale_factor, postscale_factor))
    return [compression.decompress(part, ctx) for part, (_, ctx) in zip(parts, compressed)]


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average, process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    handle = grouped_reducescatter_async([tensor], name, op, process_set, prescale_factor, postscale_factor)
    _handles[handle].then = operator.itemgetter(0)
    return handle


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set reaches the barrier."""
    signature = Signature("barrier")

    def start(group: Any) -> _Started:
        return _Started([launch(lambda: dist.all_reduce(torch.zeros(1), group=group, async_op=True))], lambda: None)

    synchronize(_submit(process_set, None, signature, start))


def join(device: int = -1) -> int:
    """A rank that ran out of data calls join(): until every rank has joined it takes part in the others'
    allreduces (with zeros; DistributedOptimizer's steps included), and allgather, broadcast, alltoall or
    reducescatter on the other ranks fail meanwhile (as in Horovod). Returns the rank that joined last."""
    controller, _ = _negotiation(global_process_set)
    return controller.join()


class _Allreduce(torch.autograd.Function):
    """Differentiable allreduce, as Horovod's: the gradient is the same reduction of the output's gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, *args: Any) -> torch.Tensor:
        average, name, compression, op, prescale_factor, postscale_factor, process_set = args
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return _allreduce(tensor, average, name, compression, op, prescale_factor, postscale_factor, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        return (_allreduce(grad, average, None, Compression.none, op, prescale_factor, postscale_factor, process_set), *[None] * 7)


def allreduce(tensor: torch.Tensor, average: Any = None, name: str | None = None, compression: type[Compressor] = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of `tensor` across all ranks, as a new tensor; `tensor` is left as it is. Differentiable."""
    return _Allreduce.apply(tensor, average, name, compression, op, prescale_factor, postscale_factor, process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        average, name, compression, op, prescale_factor, postscale_factor, process_set = args
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return tuple(_grouped_allreduce(list(tensors), average, name, compression, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        return (None, *_grouped_allreduce(list(grads), average, None, Compression.none, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce(tensors: list[torch.Tensor], average: Any = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """Every tensor reduced across all ranks (one negotiation, one fused reduction per dtype). Differentiable."""
    return list(_GroupedAllreduce.apply((average, name, compression, op, prescale_factor, postscale_factor, process_set), *tensors))


def _my_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's rows of a gathered gradient (averaged over the set), as Horovod's allgather backward."""
    reduced = _allreduce(grad, None, None, Compression.none, Average, 1.0, 1.0, process_set)
    counts = _allgather(torch.tensor([rows], dtype=torch.int64), None, process_set).tolist()
    offset = sum(counts[: process_set.rank_in(int(require_joined()["rank"]))])
    return reduced.narrow(0, offset, rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.process_set = _gathered(tensor).shape[0], process_set
        return _allgather(tensor, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _my_rows(grad, ctx.rows, ctx.process_set), None, None


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ, as in Horovod). Differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows, ctx.process_set = [_gathered(t).shape[0] for t in tensors], process_set
        return tuple(_grouped_allgather(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, *[_my_rows(g, rows, ctx.process_set) for g, rows in zip(grads, ctx.rows)])


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = _allreduce(grad, None, None, Compression.none, Average, 1.0, 1.0, ctx.process_set)
        if int(require_joined()["rank"]) != int(ctx.root_rank):
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """root_rank's value of `tensor`, as a new tensor. Differentiable (the root gets the averaged gradient)."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Any:
        output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *unused: Any) -> tuple[Any, ...]:
        """What came from each rank goes back to it: the received counts are the splits."""
        back, _ = _alltoall(grad.contiguous(), ctx.received, None, ctx.process_set)
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """The gathered slices; with `splits`, also the counts received from each rank (Horovod's two results). Differentiable."""
    return _Alltoall.apply(tensor, splits, name, process_set)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        name, compression, op, process_set, prescale_factor, postscale_factor = args
        ctx.args = (reduce_op(op), process_set, prescale_factor, postscale_factor)
        return tuple(_grouped_reducescatter(list(tensors), name, compression, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, process_set, prescale_factor, postscale_factor = ctx.args
        factor = (process_set.size() if op == Sum else 1) * prescale_factor * postscale_factor
        return (None, *_grouped_allgather([g * factor for g in grads], None, process_set))


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: type[Compressor] = Compression.none,
                          op: Any = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Each tensor reduced across ranks, this rank keeping its part of dim 0. Differentiable."""
    return list(_GroupedReducescatter.apply((name, compression, op, process_set, prescale_factor, postscale_factor), *tensors))


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]
