"""The wait accounting's cost per training step, measured inside one job (run by `python -m bench.hangs --only cost`).

Two DistributedOptimizer trainers from bench/step_time_worker.py start from the same parameters and see the same
batches; they take turns step by step (the order alternating, a barrier before each step). One writes its waits to
the worker's wait record, as every worker of a job does; the other's steps run with the record swapped for the
no-op one a worker without an agent has. Rank 0 writes the median ms per step of each, the waits per step, and
what recording one wait costs (timed apart): on a machine whose steps vary by several percent from run to run,
waits per step times that cost is the accounting's share of a step that noise cannot hide.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import libworker as hvd
from bench.step_time_worker import MODELS, Trainer
from elastic_control_plane.slot_processes.wait_record import RECORD_ENV, NoRecord, RecordReader, WaitRecord
from libworker.world import world


def timed_step(trainer: Trainer, record: WaitRecord | NoRecord) -> float:
    kept, world.waits = world.waits, record
    try:
        return trainer.step()
    finally:
        world.waits = kept


def wait_us(record: WaitRecord) -> float:
    """What recording one wait costs this process, in µs (the best of 5 runs of 10,000)."""
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(10_000):
            with record.waiting():
                pass
        runs.append((time.perf_counter() - started) / 10_000 * 1e6)
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="mlp-1M,convnet")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    recorded = world.waits
    assert isinstance(recorded, WaitRecord), "the job must run with hang detection on (the agent's wait record)"
    reader = RecordReader(os.environ[RECORD_ENV])
    results = []
    for name in args.models.split(","):
        build, make_batches, loss = MODELS[name]
        torch.manual_seed(0)
        initial = build()
        batches = make_batches(torch.Generator().manual_seed(1000 + hvd.rank()))
        trainers = {"on": Trainer("ours", initial, batches, loss), "off": Trainer("ours", initial, batches, loss)}
        records = {"on": recorded, "off": NoRecord()}
        for kind in ("on", "off"):
            for _ in range(args.warmup):
                timed_step(trainers[kind], records[kind])
        times: dict[str, list[float]] = {"on": [], "off": []}
        waits_before = reader.read().waits  # type: ignore[union-attr]
        for step in range(args.steps):
            for kind in ("on", "off") if step % 2 else ("off", "on"):
                dist.barrier()
                times[kind].append(timed_step(trainers[kind], records[kind]))
        on, off = (statistics.median(times[kind]) * 1000 for kind in ("on", "off"))
        waits = (reader.read().waits - waits_before) / args.steps  # type: ignore[union-attr]
        results.append(
            {"model": name, "on_ms": on, "off_ms": off, "waits_per_step": waits, "wait_us": wait_us(recorded)}
        )
    if hvd.rank() == 0:
        with open(args.out, "w") as out:
            json.dump(results, out)


if __name__ == "__main__":
    main()
