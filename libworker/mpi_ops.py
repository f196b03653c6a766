"""Horovod's torch collectives (`horovod.torch.mpi_ops`) over the round's process group, through the abortable core.

Same names, arguments and results as Horovod: reduce ops as constants
(`Average`, `Sum`, `Adasum`, `Min`, `Max`, `Product`; the strings "mean",
"sum", ... still work), `name=`, `prescale_factor`/`postscale_factor`,
`compression=`, and the deprecated `average=`. The `_async` forms return a
handle for `poll` / `synchronize`; allreduce and broadcast are issued at once
and overlap with the caller, the others complete before they return their
handle. A dead peer or an abort of the round makes any of them raise
WorkerInternalError (Horovod's HorovodInternalError); a handle of an earlier
round raises it too. Process sets other than the global one are refused.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from libworker import adasum
from libworker.collectives import finish, launch, run_collective, waits_on_stream
from libworker.compression import Compression, Compressor
from libworker.errors import WorkerInternalError
from libworker.world import require_joined, world

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {"mean": Average, "average": Average, "sum": Sum, "adasum": Adasum, "min": Min, "max": Max, "product": Product}
TORCH_OPS = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}


class ProcessSet:
    """Horovod's process sets: only the global one (every rank of the round) exists here."""

    def __init__(self, ranks: list[int] | None = None) -> None:
        self.ranks = ranks
        self.process_set_id = 0 if ranks is None else None

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def _unsupported_process_sets() -> NotImplementedError:
    return NotImplementedError("process sets are not supported by libworker: every collective runs over the whole round (global_process_set)")


def add_process_set(process_set: Any) -> ProcessSet:
    raise _unsupported_process_sets()


def remove_process_set(process_set: Any) -> bool:
    raise _unsupported_process_sets()


def check_process_set(process_set: Any) -> None:
    if process_set is not global_process_set:
        raise _unsupported_process_sets()


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


def check_root(root_rank: int) -> None:
    size = dist.get_world_size()
    if not 0 <= int(root_rank) < size:
        raise ValueError(f"root_rank {root_rank} is not a rank of this round (size {size})")


@dataclass
class _Pending:
    """An operation behind a handle: its works, how to wait for them, and what synchronize returns."""

    works: list[Any]
    result: Callable[[], Any]
    round: int
    on_stream: bool = False


_handles: dict[int, _Pending] = {}
_handle_ids = itertools.count(1)


def _register(works: list[Any], result: Callable[[], Any], on_stream: bool = False) -> int:
    for stale in [h for h, p in _handles.items() if p.round != world.round]:
        del _handles[stale]
    handle = next(_handle_ids)
    _handles[handle] = _Pending(works, result, world.round, on_stream)
    return handle


def poll(handle: int) -> bool:
    """True when the operation behind `handle` has completed (synchronize will not block)."""
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"unknown handle {handle!r}")
    return all(work.is_completed() for work in pending.works)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind `handle` and return its result (None for an unknown handle, as Horovod)."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    if pending.round != world.round:
        raise WorkerInternalError(f"handle {handle} belongs to round {pending.round}; the job has re-formed since (round {world.round})")
    for work in pending.works:
        finish(work, pending.on_stream)
    return pending.result()


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor != 1.0:
        tensor.mul_(factor)


def _average(tensor: torch.Tensor, size: int) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.div_(size)
    else:
        tensor.copy_(tensor.div(size, rounding_mode="floor"))


def _reduce_async_(tensors: list[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float) -> int:
    """Reduce tensors in place as one operation; the handle's result is the list of tensors."""
    require_joined()
    if op == Adasum:
        for tensor in tensors:
            _scale(tensor, prescale_factor)
        adasum.adasum_(tensors)
        for tensor in tensors:
            _scale(tensor, postscale_factor)
        return _register([], lambda: tensors)
    size = dist.get_world_size()
    works = []
    for tensor in tensors:
        _scale(tensor, prescale_factor)
        works.append(launch(lambda t=tensor: dist.all_reduce(t, op=TORCH_OPS[op], async_op=True)))

    def result() -> list[torch.Tensor]:
        for tensor in tensors:
            if op == Average:
                _average(tensor, size)
            _scale(tensor, postscale_factor)
        return tensors

    return _register(works, result, any(waits_on_stream(t) for t in tensors))


def allreduce_async_(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing `tensor` in place; `synchronize(handle)` returns it reduced."""
    check_process_set(process_set)
    handle = _reduce_async_([tensor], reduce_op(op, average), prescale_factor, postscale_factor)
    pending = _handles[handle]
    tensors_result = pending.result
    pending.result = lambda: tensors_result()[0]
    return handle


def allreduce_(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` in place across all ranks (default op: Average, as Horovod) and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(tensor: torch.Tensor, average: Any = None, name: str | None = None, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    return allreduce_async_(tensor.clone(), average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce(tensor: torch.Tensor, average: Any = None, name: str | None = None, compression: type[Compressor] = Compression.none,
              op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of `tensor` across all ranks, as a new tensor; `tensor` is left as it is."""
    compressed, ctx = compression.compress(tensor)
    reduced = allreduce_(compressed.clone() if compressed is tensor else compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _grouped_async_(tensors: list[torch.Tensor], average: Any, op: Any, prescale_factor: float, postscale_factor: float,
                    process_set: ProcessSet) -> int:
    """One fused buffer per dtype and device, reduced as one operation; results copied back into `tensors`.
    Adasum takes the tensors as they are: its coefficients are per tensor."""
    check_process_set(process_set)
    resolved = reduce_op(op, average)
    if resolved == Adasum:
        return _reduce_async_(tensors, resolved, prescale_factor, postscale_factor)
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    fused = {key: torch.cat([t.reshape(-1) for t in members]) for key, members in groups.items()}
    handle = _reduce_async_(list(fused.values()), resolved, prescale_factor, postscale_factor)
    pending = _handles[handle]
    reduce_result = pending.result

    def result() -> list[torch.Tensor]:
        reduce_result()
        for key, members in groups.items():
            for tensor, part in zip(members, fused[key].split([t.numel() for t in members])):
                tensor.copy_(part.view_as(tensor))
        return tensors

    pending.result = result
    return handle


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    return _grouped_async_(list(tensors), average, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, op: Any = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async(tensors: list[torch.Tensor], average: Any = None, name: str | None = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    return _grouped_async_([t.clone() for t in tensors], average, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors: list[torch.Tensor], average: Any = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    compressed = [compression.compress(t) for t in tensors]
    sent = [c.clone() if c is t else c for (c, _), t in zip(compressed, tensors)]
    reduced = grouped_allreduce_(sent, average, name, op, prescale_factor, postscale_factor, process_set)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: Any = None, process_set: ProcessSet = global_process_set) -> int:
    """A sparse tensor, reduced densely (its indices and values are gathered into a dense sum)."""
    dense = tensor.to_dense()
    handle = allreduce_async_(dense, name=name, op=op, process_set=process_set)
    pending = _handles[handle]
    dense_result = pending.result
    pending.result = lambda: dense_result().to_sparse()
    return handle


def broadcast_async_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    check_process_set(process_set)
    require_joined()
    check_root(root_rank)
    work = launch(lambda: dist.broadcast(tensor, src=int(root_rank), async_op=True))
    return _register([work], lambda: tensor, waits_on_stream(tensor))


def broadcast_(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with root_rank's value, in place."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    return broadcast_async_(tensor.clone(), root_rank, name, process_set)


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """root_rank's value of `tensor`, as a new tensor."""
    return broadcast_(tensor.clone(), root_rank, name, process_set)


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0, in rank order; first dimensions may differ."""
    require_joined()
    tensor = tensor if tensor.dim() > 0 else tensor.reshape(1)
    size = dist.get_world_size()
    lengths = torch.zeros(size, dtype=torch.int64, device=tensor.device)
    lengths[dist.get_rank()] = tensor.shape[0]
    run_collective(lambda: dist.all_reduce(lengths, async_op=True), waits_on_stream(lengths))
    counts = lengths.tolist()
    padded = torch.zeros((max(counts), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(size)]
    run_collective(lambda: dist.all_gather(parts, padded, async_op=True), waits_on_stream(padded))
    return torch.cat([part[:n] for part, n in zip(parts, counts)])


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    check_process_set(process_set)
    gathered = _gather(tensor)
    return _register([], lambda: gathered)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ, as in Horovod)."""
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    check_process_set(process_set)
    gathered = [_gather(t) for t in tensors]
    return _register([], lambda: gathered)


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    """Send slice j of `tensor` (along dim 0) to rank j; the result is what every rank sent here, in rank order,
    and how many rows came from each rank."""
    check_process_set(process_set)
    require_joined()
    size = dist.get_world_size()
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(f"alltoall without splits needs a first dimension divisible by the size ({tensor.shape[0]} rows, {size} ranks)")
        send = [tensor.shape[0] // size] * size
    else:
        send = [int(n) for n in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != size or sum(send) != tensor.shape[0] or min(send) < 0:
            raise ValueError(f"alltoall splits {send} must give one non-negative count per rank ({size}) summing to {tensor.shape[0]} rows")
    sent_counts = torch.tensor(send, dtype=torch.int64)
    received_counts = torch.empty(size, dtype=torch.int64)
    run_collective(lambda: dist.all_to_all_single(received_counts, sent_counts, async_op=True))
    receive = received_counts.tolist()
    output = torch.empty((sum(receive), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    run_collective(lambda: dist.all_to_all_single(output, tensor.contiguous(), receive, send, async_op=True), waits_on_stream(output))
    return _register([], lambda: (output, received_counts))


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set) -> Any:
    """The gathered slices; with `splits`, also the counts received from each rank (Horovod's two results)."""
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: Any = Average, process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    """Reduce `tensor` across ranks and keep this rank's part of dim 0 (the first ranks get one more row when the
    rows do not divide evenly, as Horovod)."""
    check_process_set(process_set)
    resolved = reduce_op(op)
    if resolved == Adasum:
        raise ValueError("reducescatter does not support Adasum")
    reduced = tensor.clone()
    synchronize(_reduce_async_([reduced], resolved, prescale_factor, postscale_factor))
    size, rank = dist.get_world_size(), dist.get_rank()
    base, extra = divmod(reduced.shape[0], size)
    start = rank * base + min(rank, extra)
    part = reduced[start : start + base + (1 if rank < extra else 0)].clone()
    return _register([], lambda: part)


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    compressed, ctx = compression.compress(tensor)
    return compression.decompress(synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor)), ctx)


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> int:
    parts = [synchronize(reducescatter_async(t, name, op, process_set, prescale_factor, postscale_factor)) for t in tensors]
    return _register([], lambda: parts)


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: type[Compressor] = Compression.none,
                          op: Any = Average, process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    return [reducescatter(t, name, compression, op, process_set, prescale_factor, postscale_factor) for t in tensors]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the round reaches the barrier."""
    check_process_set(process_set)
    require_joined()
    run_collective(lambda: dist.all_reduce(torch.zeros(1), async_op=True))


def join(device: int = -1) -> int:
    """A rank that ran out of data waits here until every rank has joined; returns the rank that joined last.

    Unlike Horovod, a rank waiting in join() does not serve the allreduces of
    ranks that still train (there is no coordinator to tell it their shapes):
    every rank must call join() before any other rank's next collective.
    """
    require_joined()
    global _joins
    _joins = (world.round, _joins[1] + 1 if _joins[0] == world.round else 1)
    arrival = dist.distributed_c10d._get_default_store().add(f"libworker/join/{_joins[1]}", 1)
    last = torch.tensor([dist.get_rank() if arrival == dist.get_world_size() else -1], dtype=torch.int64)
    return int(allreduce_(last, op=Max).item())


_joins = (0, 0)
