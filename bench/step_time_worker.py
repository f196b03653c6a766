"""One rank of `bench.step_time`: training steps of torch DDP, libworker's DistributedOptimizer and the old idiom.

    python -m bench.step_time_worker --out FILE [--models mlp-1M,convnet] [--steps 100] [--warmup 5]

Runs only as a worker of a job (`bench.step_time` starts it). Per model, the
three trainers start from the same parameters (seed 0) and step through the
same batches (this rank's, seed 1000 + rank) with SGD:
  ddp  DistributedDataParallel(model), default settings
  ours hvd.DistributedOptimizer(SGD, named_parameters=...), plain zero_grad/backward/step
  old  one hvd.allreduce_(p.grad, op="mean") per parameter after backward
After `warmup` steps each, they take turns step by step (all ranks start each
step together; the order rotates every round, so the machine's slow drifts
hit all alike) until each has timed `steps` steps; a trainer's step time is
the median of its steps. Since all took the same steps, their parameters must
agree: the largest absolute difference to DDP's is reported. Each rank uses
cores / ranks-on-the-host torch threads (at least 1). Rank 0 writes the
results as JSON to `--out`.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import libworker as hvd

WIDTH, BATCH, LR = 352, 32, 0.01
Batch = tuple[torch.Tensor, torch.Tensor]


def mlp(tensors: int) -> nn.Module:
    """`tensors` / 2 square Linear layers of WIDTH (about 124k parameters each) with ReLUs between."""
    layers: list[nn.Module] = []
    for _ in range(tensors // 2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def convnet() -> nn.Module:
    """Three 3x3 convolutions with pooling, then two Linear layers: 10 tensors, 0.6M parameters, 3x32x32 input."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(128 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, 10),
    )  # fmt: skip


def mlp_batches(generator: torch.Generator) -> list[Batch]:
    return [
        (torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, WIDTH, generator=generator))
        for _ in range(4)
    ]


def image_batches(generator: torch.Generator) -> list[Batch]:
    return [
        (torch.randn(BATCH, 3, 32, 32, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator))
        for _ in range(4)
    ]


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[torch.Generator], list[Batch]], nn.Module]] = {
    "mlp-1M": (lambda: mlp(16), mlp_batches, nn.MSELoss()),
    "mlp-2M": (lambda: mlp(32), mlp_batches, nn.MSELoss()),
    "mlp-4M": (lambda: mlp(64), mlp_batches, nn.MSELoss()),
    "mlp-8M": (lambda: mlp(128), mlp_batches, nn.MSELoss()),
    "convnet": (convnet, image_batches, nn.CrossEntropyLoss()),
}
TRAINERS = ("ddp", "ours", "old")


class Trainer:
    def __init__(self, kind: str, initial: nn.Module, batches: list[Batch], loss: nn.Module) -> None:
        self.model = copy.deepcopy(initial)
        self.forward = DistributedDataParallel(self.model) if kind == "ddp" else self.model
        sgd = torch.optim.SGD(self.model.parameters(), lr=LR)
        self.optimizer = (
            hvd.DistributedOptimizer(sgd, named_parameters=self.model.named_parameters()) if kind == "ours" else sgd
        )
        self.reduce_each = kind == "old"
        self.batches, self.loss, self.steps = batches, loss, 0

    def step(self) -> float:
        """One training step; returns its seconds."""
        x, y = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        start = time.perf_counter()
        self.optimizer.zero_grad()
        self.loss(self.forward(x), y).backward()
        if self.reduce_each:
            for p in self.model.parameters():
                hvd.allreduce_(p.grad, op="mean")
        self.optimizer.step()
        return time.perf_counter() - start


def max_abs_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def bench_model(name: str, steps: int, warmup: int) -> dict[str, object]:
    build, make_batches, loss = MODELS[name]
    torch.manual_seed(0)
    initial = build()
    batches = make_batches(torch.Generator().manual_seed(1000 + hvd.rank()))
    trainers = {kind: Trainer(kind, initial, batches, loss) for kind in TRAINERS}
    for trainer in trainers.values():
        for _ in range(warmup):
            trainer.step()
    times: dict[str, list[float]] = {kind: [] for kind in TRAINERS}
    for r in range(steps):
        for kind in TRAINERS[r % 3 :] + TRAINERS[: r % 3]:
            dist.barrier()
            times[kind].append(trainers[kind].step())
    ddp = trainers["ddp"].model
    return {
        "model": name,
        "parameters": sum(p.numel() for p in initial.parameters()),
        "tensors": len(list(initial.parameters())),
        "ms": {kind: statistics.median(values) * 1000 for kind, values in times.items()},
        "diff_ours": max_abs_diff(ddp, trainers["ours"].model),
        "diff_old": max_abs_diff(ddp, trainers["old"].model),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=100, help="Timed steps per trainer and model.")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    hvd.init()
    threads = max(1, (os.cpu_count() or 1) // hvd.local_size())
    torch.set_num_threads(threads)
    results = [bench_model(name, args.steps, args.warmup) for name in args.models.split(",")]
    if hvd.rank() == 0:
        with open(args.out, "w") as out:
            json.dump({"size": hvd.size(), "threads": threads, "results": results}, out)


if __name__ == "__main__":
    main()
