"""The train example made elastic: DistributedOptimizer + TorchState + ElasticSampler + a reset callback that rescales
the learning rate.

Hosts may join, leave, drain or die while it runs; it keeps training from the
last commit. Porting a Horovod elastic script is a change of import:
`import libworker as elastic` instead of `import horovod.torch as hvd` /
`hvd.elastic`.

    elasticctl local --hosts 2 --slots 2 --min-np 2 --max-np 4 -- python examples/train_elastic.py

`--log-dir DIR` writes one JSON line per step, commit and round entry from
every rank (the tests and benchmarks read them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset
from train import make_data, make_model, parameter_checksum

import libworker as elastic


class EventLog:
    """JSON lines, one file per process, flushed at once (a killed worker loses nothing it logged)."""

    def __init__(self, directory: str | None) -> None:
        self.file = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(directory) / f"worker-{os.environ.get('ELASTIC_HOST', 'x')}-{os.getpid()}.jsonl", "a")

    def write(self, event: str, **fields: Any) -> None:
        if self.file is None:
            return
        record = {
            "event": event,
            "time": time.time(),
            "pid": os.getpid(),
            "host": elastic.host(),
            "rank": elastic.rank(),
            "size": elastic.size(),
            "round": elastic.round_number(),
            **fields,
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.02, help="Learning rate per worker (scaled by the world size).")
    parser.add_argument("--commit-every", type=int, default=4, help="Steps between commits.")
    parser.add_argument(
        "--step-delay", type=float, default=0.0, help="Extra seconds per step (to watch changes happen)."
    )
    parser.add_argument("--log-dir", default=os.environ.get("TRAIN_LOG_DIR"))
    parser.add_argument(
        "--per-parameter-allreduce",
        action="store_true",
        help="Average gradients with one allreduce_ per parameter (the older idiom) instead of DistributedOptimizer.",
    )
    args = parser.parse_args()

    x, y = make_data(args.samples)
    dataset = TensorDataset(x, y)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    sampler = elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    loss_fn = torch.nn.MSELoss()
    model(
        x[:1]
    ).sum().backward()  # warm up autograd and kernels before joining: a joining worker is ready when admitted
    optimizer.zero_grad()

    elastic.init()
    log = EventLog(args.log_dir)
    if not args.per_parameter_allreduce:
        optimizer = elastic.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def rescale_lr() -> None:
        for group in optimizer.param_groups:
            group["lr"] = args.lr * elastic.size()

    rescale_lr()
    state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, step=0)
    state.register_reset_callbacks([rescale_lr])

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        log.write("enter", step=state.step, epoch=state.epoch, checksum=parameter_checksum(model).tolist())
        while state.epoch < args.epochs:
            sampler.set_epoch(state.epoch)
            epoch_loss, batches = torch.zeros(1), 0
            for batch_idx, (xb, yb) in enumerate(loader):
                optimizer.zero_grad()
                loss = loss_fn(model(xb), yb)
                loss.backward()
                if args.per_parameter_allreduce:
                    for p in model.parameters():
                        elastic.allreduce_(p.grad, op="mean")
                optimizer.step()
                indices = sampler.record_batch(batch_idx, args.batch_size)
                state.step += 1
                epoch_loss += loss.detach()
                batches += 1
                log.write("step", step=state.step, epoch=state.epoch, indices=indices)
                if args.step_delay:
                    time.sleep(args.step_delay)
                if state.step % args.commit_every == 0:
                    state.commit()
                    log.write("commit", step=state.step, epoch=state.epoch)
            mean_loss = elastic.allreduce(epoch_loss / max(1, batches), op="mean").item()
            if elastic.rank() == 0:
                print(f"epoch {state.epoch}: loss {mean_loss:.5f} on {elastic.size()} workers", flush=True)
            log.write("epoch_end", step=state.step, epoch=state.epoch, loss=mean_loss)
            state.epoch += 1
            state.commit()
            log.write("commit", step=state.step, epoch=state.epoch)

    train(state)
    checksums = elastic.allgather(parameter_checksum(model).unsqueeze(0))
    identical = bool(torch.all(checksums == checksums[0]))
    log.write("done", step=state.step, identical=identical, checksum=parameter_checksum(model).tolist())
    if elastic.rank() == 0:
        print(f"parameters identical on all {elastic.size()} ranks: {identical}", flush=True)
    return 0 if identical else 3


if __name__ == "__main__":
    sys.exit(main())
