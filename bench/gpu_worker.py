"""The worker of bench/gpu_smoke.py: a small model trained with libworker in Horovod's elastic idiom.

    python bench/gpu_worker.py --log-dir DIR [--device cpu|cuda] [--steps N] [--stop-file PATH]

It trains on `--device`: by default `cuda` when CUDA is available, else `cpu`.
It never calls `torch.cuda.set_device`: libworker binds each worker to its GPU
(shared round robin under `--share-gpus`). JSON lines in `--log-dir`, one file
per process: `enter` at each round entry (backend, device, CUDA memory, 0 on
the CPU, resident memory in bytes, threads, open fds), `step` after each step,
`done` at the end. It stops after `--steps`, or at the first commit where
rank 0 sees `--stop-file` (the decision is broadcast, so every rank stops at
the same step).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import libworker as hvd

FEATURES = 64


def resources(device: str) -> dict[str, int]:
    """What a reset must give back: this process's CUDA memory and the GPU's used memory (0 on the CPU), its resident
    memory in bytes, threads and open fds."""
    on_gpu = device == "cuda"
    free, total = torch.cuda.mem_get_info() if on_gpu else (0, 0)
    return {
        "memory_allocated": torch.cuda.memory_allocated() if on_gpu else 0,
        "memory_reserved": torch.cuda.memory_reserved() if on_gpu else 0,
        "device_used": total - free,
        "rss": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE"),
        "threads": len(os.listdir("/proc/self/task")),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stop-file", default=None)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.001, help="Learning rate per worker (scaled by the world size).")
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--step-delay", type=float, default=0.02, help="Seconds to sleep after each step.")
    args = parser.parse_args()

    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1)).to(
        args.device
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, batch=0)

    def on_state_reset() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()

    state.register_reset_callbacks([on_state_reset])
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    log = open(Path(args.log_dir) / f"worker-{os.environ.get('ELASTIC_HOST', 'x')}-{os.getpid()}.jsonl", "a")

    def write(event: str, **fields: Any) -> None:
        record = {
            "event": event,
            "time": time.time(),
            "pid": os.getpid(),
            "host": os.environ.get("ELASTIC_HOST"),
            "rank": hvd.rank(),
            "size": hvd.size(),
            "round": hvd.round_number(),
            **fields,
        }
        log.write(json.dumps(record) + "\n")
        log.flush()

    @hvd.elastic.run
    def train(state: Any) -> None:
        write(
            "enter",
            batch=state.batch,
            backend=str(dist.get_backend()),
            device=torch.cuda.current_device() if args.device == "cuda" else "cpu",
            **resources(args.device),
        )
        while state.batch < args.steps:
            generator = torch.Generator(device=args.device).manual_seed(state.batch * 1000 + hvd.rank())
            x = torch.randn(args.batch_size, FEATURES, device=args.device, generator=generator)
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), x.sum(dim=1, keepdim=True))
            loss.backward()
            optimizer.step()
            state.batch += 1
            write("step", batch=state.batch, loss=loss.item())
            time.sleep(args.step_delay)
            if state.batch % args.commit_every == 0:
                state.commit()
                if args.stop_file and hvd.broadcast_object(os.path.exists(args.stop_file), root_rank=0):
                    return

    train(state)
    write("done", batch=state.batch)


if __name__ == "__main__":
    main()
