"""Reductions: Horovod's reduce ops, and how a reduction runs on the data path once every rank agreed to it.

The ops are Horovod's constants (`Average`, `Sum`, `Adasum`, `Min`, `Max`,
`Product`; the strings "mean", "sum", ... and the deprecated `average=` still
resolve to them). A reduction applies the prescale factor, widens what gloo
cannot reduce (libworker.wire: int16 as int32, bool as uint8 with logical
ops), reduces, narrows back, averages and applies the postscale factor, with
Horovod's arithmetic for every dtype; Adasum goes through libworker.adasum.
A group of tensors is fused into one flat buffer per dtype and device and
reduced as one operation.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from libworker import adasum, wire
from libworker.collectives import Started, launch, waits_on_stream

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {
    "mean": Average,
    "average": Average,
    "sum": Sum,
    "adasum": Adasum,
    "min": Min,
    "max": Max,
    "product": Product,
}
TORCH_OPS = {
    Average: dist.ReduceOp.SUM,
    Sum: dist.ReduceOp.SUM,
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}
OP_WORDS = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product"}


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


def check_reducible(tensors: list[torch.Tensor], op: int) -> None:
    if any(t.dtype == torch.bool for t in tensors) and op in (Average, Adasum):
        raise ValueError(
            "bool tensors reduce with Sum or Max (logical or) and Min or Product (logical and), not Average or Adasum"
        )


def reduce_started(
    tensors: list[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float, group: Any
) -> Started:
    """Reduce tensors in place as one operation; the result is the list of tensors."""
    if op == Adasum:
        for tensor in tensors:
            wire.scale_(tensor, prescale_factor)
        adasum.adasum_(tensors, group)
        for tensor in tensors:
            wire.scale_(tensor, postscale_factor)
        return Started([], lambda: tensors)
    size = dist.get_world_size(group)
    works, sent = [], []
    for tensor in tensors:
        wire.scale_(tensor, prescale_factor)
        reduced = wire.reducible(tensor)
        torch_op = wire.BOOL_OPS[OP_WORDS[op]] if tensor.dtype == torch.bool else TORCH_OPS[op]
        works.append(launch(lambda t=reduced, o=torch_op: dist.all_reduce(t, op=o, group=group, async_op=True)))
        sent.append(reduced)

    def result() -> list[torch.Tensor]:
        for tensor, reduced in zip(tensors, sent):
            wire.narrow(tensor, reduced)
            if op == Average:
                wire.average_(tensor, size)
            wire.scale_(tensor, postscale_factor)
        return tensors

    return Started(works, result, any(waits_on_stream(t) for t in tensors))


def _fused(tensors: list[torch.Tensor]) -> tuple[dict[tuple[torch.dtype, torch.device], list[int]], list[torch.Tensor]]:
    """Indices of `tensors` per (dtype, device) in order of first appearance, and one flat buffer per group."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault((tensor.dtype, tensor.device), []).append(index)
    return groups, [torch.cat([tensors[i].reshape(-1) for i in members]) for members in groups.values()]


def grouped_reduce_started(
    tensors: list[torch.Tensor], op: int, prescale_factor: float, postscale_factor: float, group: Any
) -> Started:
    """One fused buffer per dtype and device, reduced as one operation; results copied back into `tensors`.
    Adasum takes the tensors as they are: its coefficients are per tensor."""
    if op == Adasum or len(tensors) == 1:
        return reduce_started(tensors, op, prescale_factor, postscale_factor, group)
    groups, buffers = _fused(tensors)
    started = reduce_started(buffers, op, prescale_factor, postscale_factor, group)

    def result() -> list[torch.Tensor]:
        started.result()
        for members, buffer in zip(groups.values(), buffers):
            for index, part in zip(members, buffer.split([tensors[i].numel() for i in members])):
                tensors[index].copy_(part.view_as(tensors[index]))
        return tensors

    return Started(started.works, result, started.on_stream)
