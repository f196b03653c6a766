"""A small real job: an MLP on a synthetic regression set, data-parallel with libworker's DistributedOptimizer.

Every rank generates the same data from a fixed seed, trains on its shard, averages gradients with DistributedOptimizer
(bucketed allreduce overlapped with backward), prints the loss per epoch from rank 0, and at the end checks that every
rank holds identical parameters (allgather of a checksum); it exits non-zero if they differ.

    elasticctl local --hosts 2 --slots 2 -- python examples/train.py
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable

import torch

import libworker as elastic


def make_data(samples: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    true_w = torch.randn(16, 1, generator=generator)
    y = torch.tanh(x @ true_w) + 0.05 * torch.randn(samples, 1, generator=generator)
    return x, y


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def parameter_checksum(model: torch.nn.Module) -> torch.Tensor:
    return tensors_checksum(model.parameters())


def tensors_checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Two numbers that differ when any value or its place differs (a sum, and a sum weighted by position)."""
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors])
    return torch.stack([flat.sum(), (flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    elastic.init()
    rank, size = elastic.rank(), elastic.size()
    x, y = make_data(args.samples)
    model = make_model()
    optimizer = elastic.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=args.lr), named_parameters=model.named_parameters()
    )
    loss_fn = torch.nn.MSELoss()
    shard = torch.arange(rank, args.samples, size)
    if rank == 0:
        print(f"training on {size} workers: {args.samples} samples, {args.epochs} epochs", flush=True)

    steps = len(shard) // args.batch_size
    for epoch in range(args.epochs):
        order = shard[torch.randperm(len(shard), generator=torch.Generator().manual_seed(epoch))]
        epoch_loss = torch.zeros(1)
        for step in range(steps):
            batch = order[step * args.batch_size : (step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(x[batch]), y[batch])
            loss.backward()
            optimizer.step()
            epoch_loss += loss.detach()
        mean_loss = elastic.allreduce(epoch_loss / steps, op="mean").item()
        if rank == 0:
            print(f"epoch {epoch}: loss {mean_loss:.5f}", flush=True)

    checksums = elastic.allgather(parameter_checksum(model).unsqueeze(0))
    identical = bool(torch.all(checksums == checksums[0]))
    if rank == 0:
        print(f"parameters identical on all {size} ranks: {identical}", flush=True)
    return 0 if identical else 3


if __name__ == "__main__":
    sys.exit(main())
