"""Adasum (Horovod's adaptive summation) over the ranks of the round, for a list of tensors reduced together.

Two gradients a and b combine as `(1 - a·b / 2|a|²) a + (1 - a·b / 2|b|²) b`:
their sum when they are orthogonal, their average when they are equal. Ranks
combine pairwise in a binary tree, as in Horovod: ranks at distance 1 first
((0,1), (2,3), ...), then the pairs at distance 2, and so on, so the number of
ranks must be a power of two. At each level a rank exchanges its whole
buffer with its partner and both compute the same combination (the lower
rank's part as `a`), so every rank ends with identical bits. Coefficients are
computed per tensor, never over the fused buffer, in float64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from libworker.collectives import finish, launch, waits_on_stream

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


def adasum_(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Replace each tensor by the Adasum of its values on every rank (in place); returns the tensors."""
    size, rank = dist.get_world_size(), dist.get_rank()
    check_world_size(size)
    if size == 1 or not tensors:
        return tensors
    mine = torch.cat([t.detach().reshape(-1) for t in tensors])
    theirs = torch.empty_like(mine)
    sizes = [t.numel() for t in tensors]
    distance = 1
    while distance < size:
        partner = rank ^ distance
        sending = launch(lambda: dist.isend(mine, partner))
        receiving = launch(lambda: dist.irecv(theirs, partner))
        finish(sending, waits_on_stream(mine))
        finish(receiving, waits_on_stream(theirs))
        low, high = (mine, theirs) if rank < partner else (theirs, mine)
        mine = torch.cat([combine(a, b) for a, b in zip(low.split(sizes), high.split(sizes))]).to(theirs.dtype)
        distance *= 2
    for tensor, result in zip(tensors, mine.split(sizes)):
        tensor.copy_(result.view_as(tensor))
    return tensors
