"""A Horovod elastic PyTorch script, written as Horovod's own examples are, with only the import changed.

Shaped like Horovod's `examples/elastic/pytorch/pytorch_mnist_elastic.py` (a
convolutional classifier on synthetic 28x28 digits, so nothing is
downloaded): `hvd.elastic.ElasticSampler`, `hvd.DistributedOptimizer` with
`named_parameters`, `compression` and `op`, metrics averaged with
`hvd.allreduce(t, name=...)`, `hvd.elastic.TorchState(model, optimizer, ...)`,
a reset callback that rescales the learning rate, and `@hvd.elastic.run`.

    elasticctl local --hosts 2 --slots 2 -- python examples/horovod_elastic.py

`--log-dir DIR` writes one JSON line per committed batch and per epoch from
every rank (the tests read them).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader, TensorDataset

import libworker as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="Horovod-style elastic training on synthetic digits")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--samples", type=int, default=2048)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--batches-per-commit", type=int, default=4)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--step-delay", type=float, default=0.0, help="Extra seconds per batch (to watch faults happen).")
parser.add_argument("--log-dir", default=os.environ.get("TRAIN_LOG_DIR"))
args = parser.parse_args()
args.cuda = torch.cuda.is_available()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5)
        self.fc1 = nn.Linear(256, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_digits(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(42)
    prototypes = torch.randn(10, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    images = prototypes[labels] + 0.8 * torch.randn(samples, 1, 28, 28, generator=generator)
    return TensorDataset(images, labels)


hvd.init()
torch.manual_seed(1)
if args.cuda:
    torch.cuda.set_device(hvd.local_rank())

train_dataset = synthetic_digits(args.samples)
train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=1)
train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)

model = Net()
lr_scaler = hvd.size() if not args.use_adasum else 1
if args.cuda:
    model.cuda()
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(
    optimizer,
    named_parameters=model.named_parameters(),
    compression=compression,
    op=hvd.Adasum if args.use_adasum else hvd.Average,
    gradient_predivide_factor=args.gradient_predivide_factor,
)

log_file = None
if args.log_dir:
    os.makedirs(args.log_dir, exist_ok=True)
    log_file = open(os.path.join(args.log_dir, f"worker-{os.getpid()}.jsonl"), "a")


def log(event: str, **fields: object) -> None:
    if log_file is not None:
        log_file.write(
            json.dumps(
                {
                    "event": event,
                    "time": time.time(),
                    "pid": os.getpid(),
                    "rank": hvd.rank(),
                    "size": hvd.size(),
                    **fields,
                }
            )
            + "\n"
        )
        log_file.flush()


def epoch_loss_average(loss_sum: torch.Tensor, batches: int) -> float | None:
    """The mean loss over the batches every rank ran in this epoch since the last reset; None if none ran (a reset
    landed after the epoch's last batch was committed)."""
    totals = hvd.allreduce(
        torch.cat([loss_sum.detach(), torch.tensor([float(batches)])]), op=hvd.Sum, name="epoch_loss"
    )
    return (totals[0] / totals[1]).item() if totals[1] > 0 else None


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    for state.epoch in range(state.epoch, args.epochs + 1):  # noqa: B020 (Horovod's idiom; range is built once)
        state.model.train()
        train_sampler.set_epoch(state.epoch)
        epoch_loss, batches = torch.zeros(1), 0
        for batch_idx, (data, target) in enumerate(train_loader):
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            state.optimizer.zero_grad()
            loss = F.nll_loss(state.model(data), target)
            loss.backward()
            state.optimizer.step()
            epoch_loss += loss.detach().cpu()
            batches += 1
            state.train_sampler.record_batch(batch_idx, args.batch_size)
            state.batch = batch_idx
            if args.step_delay:
                time.sleep(args.step_delay)
            if (batch_idx + 1) % args.batches_per_commit == 0:
                state.commit()
                log("commit", epoch=state.epoch, batch=batch_idx)
        loss_avg = epoch_loss_average(epoch_loss, batches)
        if hvd.rank() == 0 and loss_avg is not None:
            print(f"Train Epoch: {state.epoch}\tLoss: {loss_avg:.6f}\tworkers: {hvd.size()}", flush=True)
        log("epoch", epoch=state.epoch, loss=loss_avg)
        state.batch = 0
        state.commit()


def on_state_reset() -> None:
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.lr * (hvd.size() if not args.use_adasum else 1)


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
train(state)

checksum = torch.cat([p.detach().reshape(-1).double().cpu() for p in model.parameters()]).sum().reshape(1)
identical = bool(torch.all(hvd.allgather(checksum) == checksum))
if hvd.rank() == 0:
    print(f"parameters identical on all {hvd.size()} ranks: {identical}", flush=True)
hvd.shutdown()
raise SystemExit(0 if identical else 3)
