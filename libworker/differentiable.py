"""Horovod's out-of-place collectives, differentiable as Horovod's: `allreduce`, `grouped_allreduce`, `allgather`,
`grouped_allgather`, `broadcast`, `alltoall`, `reducescatter`, `grouped_reducescatter`.

Each returns a new tensor and leaves its input as it is (compressing and
decompressing around the reduction when given `compression=`), through the
asynchronous forms of libworker.async_ops. Each is an autograd Function whose
backward sends the gradient back through the matching collective: an
allreduce's gradient is the same reduction, an allgather's is this rank's
rows of the averaged gradient, a broadcast's goes to the root, an alltoall's
goes back by the received splits, and a reducescatter's is gathered.
"""

from __future__ import annotations

from typing import Any

import torch

from libworker.async_ops import (
    allgather_async,
    allreduce_,
    alltoall_async,
    broadcast_,
    gatherable,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_reducescatter_async,
)
from libworker.compression import Compression, Compressor
from libworker.handles import synchronize
from libworker.process_sets import ProcessSet, global_process_set
from libworker.reduction import Average, Sum, reduce_op
from libworker.world import require_joined


def _allreduce(
    tensor: torch.Tensor,
    average: Any = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """The reduction of `tensor` across all ranks, as a new tensor; `tensor` is left as it is."""
    compressed, ctx = compression.compress(tensor)
    reduced = allreduce_(
        compressed.clone() if compressed is tensor else compressed,
        average,
        name,
        op,
        prescale_factor,
        postscale_factor,
        process_set,
    )
    return compression.decompress(reduced, ctx)


def _grouped_allreduce(
    tensors: list[torch.Tensor],
    average: Any = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    compressed = [compression.compress(t) for t in tensors]
    sent = [c.clone() if c is t else c for (c, _), t in zip(compressed, tensors)]
    reduced = grouped_allreduce_(sent, average, name, op, prescale_factor, postscale_factor, process_set)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)]


def _broadcast(
    tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """root_rank's value of `tensor`, as a new tensor."""
    return broadcast_(tensor.clone(), root_rank, name, process_set)


def _allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ, as in Horovod)."""
    return synchronize(allgather_async(tensor, name, process_set))


def _grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def _alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """The gathered slices; with `splits`, also the counts received from each rank (Horovod's two results)."""
    output, received = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received)


def _grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    compressed = [compression.compress(t) for t in tensors]
    parts = synchronize(
        grouped_reducescatter_async(
            [c for c, _ in compressed], name, op, process_set, prescale_factor, postscale_factor
        )
    )
    return [compression.decompress(part, ctx) for part, (_, ctx) in zip(parts, compressed)]


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
        return (
            _allreduce(grad, average, None, Compression.none, op, prescale_factor, postscale_factor, process_set),
            *[None] * 7,
        )


def allreduce(
    tensor: torch.Tensor,
    average: Any = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """The reduction of `tensor` across all ranks, as a new tensor; `tensor` is left as it is. Differentiable."""
    return _Allreduce.apply(tensor, average, name, compression, op, prescale_factor, postscale_factor, process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        average, name, compression, op, prescale_factor, postscale_factor, process_set = args
        ctx.args = (average, op, prescale_factor, postscale_factor, process_set)
        return tuple(
            _grouped_allreduce(
                list(tensors), average, name, compression, op, prescale_factor, postscale_factor, process_set
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        average, op, prescale_factor, postscale_factor, process_set = ctx.args
        return (
            None,
            *_grouped_allreduce(
                list(grads), average, None, Compression.none, op, prescale_factor, postscale_factor, process_set
            ),
        )


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: Any = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Every tensor reduced across all ranks (one negotiation, one fused reduction per dtype). Differentiable."""
    return list(
        _GroupedAllreduce.apply(
            (average, name, compression, op, prescale_factor, postscale_factor, process_set), *tensors
        )
    )


def _my_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's rows of a gathered gradient (averaged over the set), as Horovod's allgather backward."""
    reduced = _allreduce(grad, None, None, Compression.none, Average, 1.0, 1.0, process_set)
    counts = _allgather(torch.tensor([rows], dtype=torch.int64), None, process_set).tolist()
    offset = sum(counts[: process_set.rank_in(int(require_joined()["rank"]))])
    return reduced.narrow(0, offset, rows)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows, ctx.process_set = gatherable(tensor).shape[0], process_set
        return _allgather(tensor, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _my_rows(grad, ctx.rows, ctx.process_set), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ, as in Horovod). Differentiable."""
    return _Allgather.apply(tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.rows, ctx.process_set = [gatherable(t).shape[0] for t in tensors], process_set
        return tuple(_grouped_allgather(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, *[_my_rows(g, rows, ctx.process_set) for g, rows in zip(grads, ctx.rows)])


def grouped_allgather(
    tensors: list[torch.Tensor], name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[torch.Tensor]:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, process_set: ProcessSet
    ) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _broadcast(tensor, root_rank, name, process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        reduced = _allreduce(grad, None, None, Compression.none, Average, 1.0, 1.0, ctx.process_set)
        if int(require_joined()["rank"]) != int(ctx.root_rank):
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
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


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """The gathered slices; with `splits`, also the counts received from each rank (Horovod's two results).
    Differentiable."""
    return _Alltoall.apply(tensor, splits, name, process_set)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, args: tuple[Any, ...], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        name, compression, op, process_set, prescale_factor, postscale_factor = args
        ctx.args = (reduce_op(op), process_set, prescale_factor, postscale_factor)
        return tuple(
            _grouped_reducescatter(list(tensors), name, compression, op, process_set, prescale_factor, postscale_factor)
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, process_set, prescale_factor, postscale_factor = ctx.args
        factor = (process_set.size() if op == Sum else 1) * prescale_factor * postscale_factor
        return (None, *_grouped_allgather([g * factor for g in grads], None, process_set))


def grouped_reducescatter(
    tensors: list[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """Each tensor reduced across ranks, this rank keeping its part of dim 0. Differentiable."""
    return list(
        _GroupedReducescatter.apply((name, compression, op, process_set, prescale_factor, postscale_factor), *tensors)
    )


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    return grouped_reducescatter([tensor], name, compression, op, process_set, prescale_factor, postscale_factor)[0]
