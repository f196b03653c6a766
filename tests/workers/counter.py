"""A job that commits after every batch: a batch counter and a sum of batch numbers, which end exactly at the totals
of a run without failures when no committed batch is lost or repeated. Every batch trains on data fixed by its
number, so the parameters end the same on every rank (a reset callback scales the learning rate to the world
size, as Horovod scripts do). `--crash-at N` makes every rank die at batch N, every time: a job
that cannot get past a commit. `--mib N` adds an N-MiB buffer (not trained) to the model: a bigger state to
snapshot, restore and sync. `--batches-file F`: once F exists the job ends at the number it holds (a soak that
ends the job when its faults are done)."""

import argparse
import os
import time

import torch
from train_elastic import EventLog

import libworker as elastic

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=200)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--log-dir")
parser.add_argument("--crash-at", type=int, default=0, help="Every rank exits 1 on reaching this batch, every time.")
parser.add_argument(
    "--batches-file", help="Once this file exists, the number of batches is the one it holds (not --batches)."
)
parser.add_argument("--mib", type=int, default=0, help="MiB of extra model state, a buffer the training leaves alone.")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
if args.mib:
    model.register_buffer("ballast", torch.zeros(args.mib << 18))
optimizer = elastic.DistributedOptimizer(
    torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
)
elastic.init()
log = EventLog(args.log_dir)
state = elastic.TorchState(model=model, optimizer=optimizer, batch=0, total=0)


def scale_lr() -> None:
    """A reset callback, as Horovod scripts have: the learning rate follows the world size."""
    for group in optimizer.param_groups:
        group["lr"] = 0.01 * elastic.size()


scale_lr()
state.register_reset_callbacks([scale_lr])


def batches() -> int:
    """The number of batches to train: --batches, until --batches-file exists (every rank reads the same file)."""
    if args.batches_file and os.path.exists(args.batches_file):
        with open(args.batches_file) as f:
            return int(f.read())
    return args.batches


@elastic.run
def train(state: elastic.TorchState) -> None:
    # Where this worker may run and which GPUs it sees, and what Slurm's task variables tell it (tests/slurm).
    placed = {"cpus": sorted(os.sched_getaffinity(0)), "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}
    log.write("enter", batch=state.batch, total=state.total, slurm_procid=os.environ.get("SLURM_PROCID"), **placed)
    while state.batch < batches():
        data = torch.Generator().manual_seed(state.batch)
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        if args.crash_at and state.batch == args.crash_at:
            raise SystemExit(1)
        state.total += state.batch
        state.batch += 1
        time.sleep(args.step_delay)
        state.commit()
        log.write("commit", batch=state.batch, total=state.total)


train(state)
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
log.write("done", batch=state.batch, total=state.total, weights=weights.tolist())
if elastic.rank() == 0:
    print(f"done: batch {state.batch}, total {state.total}", flush=True)
