"""Horovod's asynchronous collectives and the in-place forms that wait for them: `allreduce_async_`, `allreduce_`,
`broadcast_async`, `allgather_async`, `alltoall_async`, `reducescatter_async`, `barrier`, ...

Each front end resolves and checks its arguments as Horovod does (reduce op,
root rank, splits, dtypes), describes the operation as a negotiation
Signature, and submits it with the launcher that moves its data once every
rank agreed (libworker.handles); it returns the handle, or waits for it.
Reductions run through libworker.reduction; data moved as it is travels
through libworker.wire, which makes every dtype exact on gloo.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist

from libworker import wire
from libworker.collectives import Started, launch, run_collective, waits_on_stream
from libworker.errors import CollectiveMismatchError
from libworker.handles import map_result, submit, synchronize
from libworker.process_sets import ProcessSet, global_process_set
from libworker.reduction import Adasum, Average, check_reducible, grouped_reduce_started, reduce_op, reduce_started
from libworker.signatures import Signature, tensor_signature
from libworker.world import require_joined


def _check_root(root_rank: int, process_set: ProcessSet) -> None:
    size = int(require_joined()["size"])
    if not 0 <= int(root_rank) < size:
        raise ValueError(f"root_rank {root_rank} is not a rank of this round (size {size})")
    if process_set.process_set_id not in (0, None) and int(root_rank) not in process_set.ranks:
        raise ValueError(f"root_rank {root_rank} is not a member of {process_set}")


def _reduce_signature(
    tensors: list[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float
) -> Signature:
    return Signature(
        "allreduce",
        tuple(tensor_signature(t) for t in tensors),
        op,
        -1,
        float(prescale_factor),
        float(postscale_factor),
        _device_label(tensors),
    )


def _device_label(tensors: list[torch.Tensor]) -> str:
    return "cuda" if tensors and tensors[0].is_cuda else "cpu"


def allreduce_async_(
    tensor: torch.Tensor,
    average: Any = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start reducing `tensor` in place; `synchronize(handle)` returns it reduced."""
    resolved = reduce_op(op, average)
    check_reducible([tensor], resolved)
    signature = _reduce_signature([tensor], resolved, prescale_factor, postscale_factor)

    def start(group: Any) -> Started:
        started = reduce_started([tensor], resolved, prescale_factor, postscale_factor, group)
        return Started(started.works, lambda: started.result()[0], started.on_stream)

    return submit(process_set, name, signature, start)


def allreduce_(
    tensor: torch.Tensor,
    average: Any = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` in place across all ranks (default op: Average, as Horovod) and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_async(
    tensor: torch.Tensor,
    average: Any = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    return allreduce_async_(tensor.clone(), average, name, op, prescale_factor, postscale_factor, process_set)


def _grouped_async_(
    tensors: list[torch.Tensor],
    average: Any,
    name: str | None,
    op: Any,
    prescale_factor: float,
    postscale_factor: float,
    process_set: ProcessSet,
) -> int:
    resolved = reduce_op(op, average)
    check_reducible(tensors, resolved)
    signature = _reduce_signature(tensors, resolved, prescale_factor, postscale_factor)
    return submit(
        process_set,
        name,
        signature,
        lambda group: grouped_reduce_started(tensors, resolved, prescale_factor, postscale_factor, group),
    )


def grouped_allreduce_async_(
    tensors: list[torch.Tensor],
    average: Any = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    return _grouped_async_(list(tensors), average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(
    tensors: list[torch.Tensor],
    average: Any = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce_async(
    tensors: list[torch.Tensor],
    average: Any = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    return _grouped_async_(
        [t.clone() for t in tensors], average, name, op, prescale_factor, postscale_factor, process_set
    )


class _SparseHandle(int):
    """Horovod's sparse_allreduce_async returns a function to call for the result; this is also a handle."""

    def __call__(self) -> torch.Tensor:
        return synchronize(self)


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None = None, op: Any = None, process_set: ProcessSet = global_process_set
) -> _SparseHandle:
    """A sparse tensor, reduced densely; call the result (or synchronize it) for the reduced sparse tensor."""
    handle = allreduce_async_(tensor.to_dense(), name=name, op=op, process_set=process_set)
    return _SparseHandle(map_result(handle, torch.Tensor.to_sparse))


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    _check_root(root_rank, process_set)
    signature = Signature("broadcast", (tensor_signature(tensor),), root=int(root_rank), device=_device_label([tensor]))

    def start(group: Any) -> Started:
        dense = tensor if tensor.is_contiguous() else tensor.contiguous()
        sent = dense.reshape(-1).view(torch.uint8) if wire.moves_as_bytes(dense) else dense
        work = launch(lambda: dist.broadcast(sent, src=int(root_rank), group=group, async_op=True))

        def result() -> torch.Tensor:
            if dense is not tensor:
                tensor.copy_(dense)
            return tensor

        return Started([work], result, waits_on_stream(tensor))

    return submit(process_set, name, signature, start)


def broadcast_(
    tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Overwrite `tensor` with root_rank's value, in place."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    return broadcast_async_(tensor.clone(), root_rank, name, process_set)


def _gather_started(tensor: torch.Tensor, group: Any) -> Started:
    """Every rank's tensor concatenated along dim 0, in rank order; first dimensions may differ."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
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

    return Started([work], result, waits_on_stream(padded))


def gatherable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as it is gathered: a scalar travels as one row."""
    return tensor if tensor.dim() > 0 else tensor.reshape(1)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    tensor = gatherable(tensor)
    signature = Signature("allgather", (tensor_signature(tensor, skip_first=True),), device=_device_label([tensor]))
    return submit(process_set, name, signature, lambda group: _gather_started(tensor, group))


def grouped_allgather_async(
    tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    tensors = [gatherable(t) for t in tensors]
    signature = Signature(
        "allgather", tuple(tensor_signature(t, skip_first=True) for t in tensors), device=_device_label(tensors)
    )

    def start(group: Any) -> Started:
        started = [_gather_started(t, group) for t in tensors]
        return Started(
            [w for s in started for w in s.works],
            lambda: [s.result() for s in started],
            any(s.on_stream for s in started),
        )

    return submit(process_set, name, signature, start)


def _splits(tensor: torch.Tensor, splits: Any, size: int) -> list[int]:
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(
                f"alltoall without splits needs a first dimension divisible by the size ({tensor.shape[0]} rows, "
                f"{size} ranks)"
            )
        return [tensor.shape[0] // size] * size
    if isinstance(splits, torch.Tensor) and splits.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"alltoall splits must be a tensor of int32 or int64, not {splits.dtype}")
    send = [int(n) for n in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(send) != size or sum(send) != tensor.shape[0] or min(send) < 0:
        raise ValueError(
            f"alltoall splits {send} must give one non-negative count per rank ({size}) summing to "
            f"{tensor.shape[0]} rows"
        )
    return send


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> int:
    """Send slice j of `tensor` (along dim 0) to rank j; the result is what every rank sent here, in rank order,
    and how many rows came from each rank."""
    require_joined()
    if tensor.dim() == 0:
        raise ValueError("alltoall needs a tensor of at least one dimension")
    send = _splits(tensor, splits, len(process_set._ranks()))
    signature = Signature("alltoall", (tensor_signature(tensor, skip_first=True),), device=_device_label([tensor]))

    def start(group: Any) -> Started:
        size = dist.get_world_size(group)
        sent_counts = torch.tensor(send, dtype=torch.int64)
        received_counts = torch.empty(size, dtype=torch.int64)
        run_collective(lambda: dist.all_to_all_single(received_counts, sent_counts, group=group, async_op=True))
        receive = received_counts.tolist()
        output = torch.empty((sum(receive), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        as_bytes = wire.moves_as_bytes(tensor)
        out_wire = wire.as_rows_of_bytes(output) if as_bytes else output
        in_wire = wire.as_rows_of_bytes(tensor.contiguous()) if as_bytes else tensor.contiguous()
        work = launch(lambda: dist.all_to_all_single(out_wire, in_wire, receive, send, group=group, async_op=True))
        return Started([work], lambda: (output, received_counts), waits_on_stream(output))

    return submit(process_set, name, signature, start)


def _scatter_part(reduced: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    base, extra = divmod(reduced.shape[0], size)
    start = rank * base + min(rank, extra)
    return reduced[start : start + base + (1 if rank < extra else 0)].clone()


def _check_scatterable(tensors: list[torch.Tensor], op: int) -> None:
    if op == Adasum:
        raise CollectiveMismatchError("reducescatter does not support Adasum")
    if any(t.dim() == 0 for t in tensors):
        raise ValueError("reducescatter needs tensors of at least one dimension")
    check_reducible(tensors, op)


def grouped_reducescatter_async(
    tensors: list[torch.Tensor],
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Reduce each tensor across ranks and keep this rank's part of dim 0 (the first ranks get one more row when
    the rows do not divide evenly, as Horovod); one negotiation and one fused reduction for the group."""
    resolved = reduce_op(op)
    _check_scatterable(tensors, resolved)
    reduced = [t.clone() for t in tensors]
    signature = Signature(
        "reducescatter",
        tuple(tensor_signature(t) for t in tensors),
        resolved,
        -1,
        float(prescale_factor),
        float(postscale_factor),
        _device_label(tensors),
    )

    def start(group: Any) -> Started:
        started = grouped_reduce_started(reduced, resolved, prescale_factor, postscale_factor, group)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return Started(
            started.works, lambda: [_scatter_part(r, size, rank) for r in started.result()], started.on_stream
        )

    return submit(process_set, name, signature, start)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    handle = grouped_reducescatter_async([tensor], name, op, process_set, prescale_factor, postscale_factor)
    return map_result(handle, operator.itemgetter(0))


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Wait until every rank of the set reaches the barrier."""
    signature = Signature("barrier")

    def start(group: Any) -> Started:
        return Started([launch(lambda: dist.all_reduce(torch.zeros(1), group=group, async_op=True))], lambda: None)

    synchronize(submit(process_set, None, signature, start))
