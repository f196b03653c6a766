"""How a tensor travels on the data path, exactly, whatever its dtype: gloo has no int16 for any op, and bool
has no sum; scale factors and averaging follow Horovod's arithmetic for every dtype.

- Reductions: int16 is reduced as int32 and narrowed back (two's complement
  wraps as int16 arithmetic would), bool as uint8 with Sum/Max as logical
  or and Min/Product as logical and.
- Data moved as it is (broadcast, allgather, alltoall): a dtype gloo lacks
  travels as its bytes, which is exact.
- Scale factors: integer tensors are scaled in float64 and truncated back,
  float16 on the CPU in float32 (Horovod's rules); an integer average
  truncates toward zero, as Horovod's integer division does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NOT_ON_GLOO = frozenset({torch.int16})
BOOL_OPS = {"sum": dist.ReduceOp.MAX, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.MIN}


def reducible(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor to reduce in `tensor`'s place (itself when gloo reduces its dtype); `narrow` copies it back."""
    if tensor.dtype in NOT_ON_GLOO and not tensor.is_cuda:
        return tensor.to(torch.int32)
    if tensor.dtype == torch.bool:
        return tensor.to(torch.uint8)
    return tensor


def narrow(tensor: torch.Tensor, reduced: torch.Tensor) -> None:
    if reduced is not tensor:
        tensor.copy_(reduced)


def as_rows_of_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (at least 1-D, contiguous) as uint8 rows, the first dimension kept: exact for any dtype."""
    return tensor.reshape(tensor.shape[0], -1).view(torch.uint8)


def from_rows_of_bytes(rows: torch.Tensor, dtype: torch.dtype, trailing: tuple[int, ...]) -> torch.Tensor:
    return rows.view(dtype).reshape(rows.shape[0], *trailing)


def moves_as_bytes(tensor: torch.Tensor) -> bool:
    return tensor.dtype in NOT_ON_GLOO and not tensor.is_cuda


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply in place by `factor` with Horovod's arithmetic for the dtype."""
    if factor == 1.0:
        return
    if not (tensor.dtype.is_floating_point or tensor.dtype.is_complex):
        tensor.copy_(tensor.to(torch.float64) * factor)
    elif tensor.dtype == torch.float16 and not tensor.is_cuda:
        tensor.copy_(tensor.float() * factor)
    else:
        tensor.mul_(factor)


def average_(tensor: torch.Tensor, size: int) -> None:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.div_(size)
    else:
        tensor.copy_(tensor.div(size, rounding_mode="trunc"))
