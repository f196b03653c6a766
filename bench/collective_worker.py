"""One rank of `bench.collective_overhead`: libworker's allreduce_ (negotiated, with and without the cache, and
as a batch of 8 async calls) against raw torch.distributed.all_reduce.

    python -m bench.collective_worker --out FILE [--rounds 15] [--budget 0.15]

Runs only as a worker of a job (`bench.collective_overhead` starts it). For
each size, in rounds whose order rotates, every method reduces the same
float32 tensor (op sum) `calls` times back to back, each call timed; the
result is the median over all calls (this machine's latency has a long tail
of scheduling delays, which block means would pick up). `calls` shrinks with
the size so that one block takes about `budget` seconds. Each rank uses
cores / ranks-on-the-host torch threads, as in `bench.step_time`. Rank 0
writes {method: {bytes: median seconds per call}} to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import libworker as hvd

SIZES = [4, 64, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
BATCH = 8


def without_cache(tensor: torch.Tensor) -> object:
    """Every negotiation takes the full path (the ranks exchange the whole signature), as with no cache."""
    os.environ["ELASTIC_NEGOTIATION_CACHE"] = "0"
    try:
        return hvd.allreduce_(tensor, op=hvd.Sum)
    finally:
        del os.environ["ELASTIC_NEGOTIATION_CACHE"]


def chunks(tensor: torch.Tensor) -> list[torch.Tensor]:
    return list(tensor.chunk(BATCH)) if tensor.numel() >= BATCH else [tensor]


def batched(tensor: torch.Tensor) -> object:
    """BATCH async allreduces submitted, then synchronized: one negotiation cycle for the batch."""
    for handle in [hvd.allreduce_async_(part, op=hvd.Sum) for part in chunks(tensor)]:
        hvd.synchronize(handle)
    return tensor


def raw_batch(tensor: torch.Tensor) -> object:
    """The same BATCH allreduces, raw: what `batched` is compared with."""
    for work in [dist.all_reduce(part, async_op=True) for part in chunks(tensor)]:
        work.wait()
    return tensor


METHODS: dict[str, Callable[[torch.Tensor], object]] = {
    "raw": lambda t: dist.all_reduce(t),
    "ours": lambda t: hvd.allreduce_(t, op=hvd.Sum),
    "ours_no_cache": without_cache,
    "raw_8_async": raw_batch,
    "ours_8_async": batched,
}


def timed_calls(method: Callable[[torch.Tensor], object], tensor: torch.Tensor, calls: int) -> list[float]:
    dist.barrier()
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        method(tensor)
        seconds.append(time.perf_counter() - start)
    return seconds


def calls_for(size: int, budget: float) -> int:
    """Calls per block so that a block takes about `budget` seconds, at about 1 ms + 1 ns per byte a call here."""
    return max(2, round(budget / (1e-3 + size * 1e-9)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--budget", type=float, default=0.15, help="Seconds per timed block.")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    names = list(METHODS)
    results: dict[str, dict[int, float]] = {name: {} for name in names}
    for size in SIZES:
        tensor = torch.zeros(size // 4)  # sums of zeros: the values never grow to inf over many calls
        calls = calls_for(size, args.budget)
        per_call: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                per_call[name] += timed_calls(METHODS[name], tensor, calls)
        for name in names:
            results[name][size] = statistics.median(per_call[name])
    if hvd.rank() == 0:
        with open(args.out, "w") as out:
            json.dump({"size": hvd.size(), "results": results}, out)


if __name__ == "__main__":
    main()
