"""Adasum (Horovod's adaptive summation) over the ranks of the round, for a list of tensors reduced together.

Two gradients a and b combine as `(1 - a·b / 2|a|²) a + (1 - a·b / 2|b|²) b`:
their sum when they are orthogonal, their average when they are equal. Ranks
combine pairwise in a binary tree, as in Horovod's recursive halving: ranks at
distance 1 first ((0,1), (2,3), ...), then the pairs at distance 2, and so on,
so the number of ranks must be a power of two. The vectors travel in one
allgather (gloo's point-to-point work cannot be waited for abortably) and
every rank computes the same tree in the same order, so every rank ends with
identical bits; Horovod's halving moves less data, which matters beyond a few
ranks. Coefficients are computed per tensor, never over the fused buffer, in
float64.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from libworker.collectives import run_collective, waits_on_stream

TINY_NORM = 1e-8


def check_world_size(size: int) -> None:
    if size & (size - 1):
        raise ValueError(f"Adasum needs a power-of-two number of ranks; this round has {size}")


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Adasum of two vectors (a coefficient stays 1 where a norm is too small to divide by)."""
    a, b = a.double(), b.double()
    dot, a_norm, b_norm = torch.dot(a, b).item(), torch.dot(a, a).item(), torch.dot(b, b).item()
    a_coeff = 1.0 - dot / (2.0 * a_norm) if a_norm >= TINY_NORM else 1.0
    b_coeff = 1.0 - dot / (2.0 * b_norm) if b_norm >= TINY_NORM else 1.0
    return a * a_coeff + b * b_coeff


def combine_tree(vectors: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Every rank's vector combined pairwise, neighbours first ((0,1), (2,3), ...), then the pairs' results."""
    level = vectors
    while len(level) > 1:
        level = [
            torch.cat([combine(a, b) for a, b in zip(low.split(sizes), high.split(sizes))])
            for low, high in zip(level[0::2], level[1::2])
        ]
    return level[0]


def adasum_(tensors: list[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """Replace each tensor by the Adasum of its values on every rank of `group` (in place); returns the tensors."""
    size = dist.get_world_size(group)
    check_world_size(size)
    if size == 1 or not tensors:
        return tensors
    mine = torch.cat([t.detach().reshape(-1) for t in tensors])
    everyone = [torch.empty_like(mine) for _ in range(size)]
    run_collective(lambda: dist.all_gather(everyone, mine, group=group, async_op=True), waits_on_stream(mine))
    sizes = [t.numel() for t in tensors]
    result = combine_tree(everyone, sizes).to(mine.dtype)
    for tensor, part in zip(tensors, result.split(sizes)):
        tensor.copy_(part.view_as(tensor))
    return tensors
