"""A job that commits after every batch: a batch counter and a sum of batch numbers, which end exactly at the totals
of a run without failures when no committed batch is lost or repeated. Every batch trains on data fixed by its
number, so the parameters end the same too."""

import argparse
import time

import torch

import libworker as elastic
from train_elastic import EventLog

parser = argparse.ArgumentParser()
parser.add_argument("--batches", type=int, default=200)
parser.add_argument("--step-delay", type=float, default=0.02)
parser.add_argument("--log-dir")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = elastic.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), named_parameters=model.named_parameters())
elastic.init()
log = EventLog(args.log_dir)
state = elastic.TorchState(model=model, optimizer=optimizer, batch=0, total=0)


@elastic.run
def train(state: elastic.TorchState) -> None:
    log.write("enter", batch=state.batch, total=state.total)
    while state.batch < args.batches:
        data = torch.Generator().manual_seed(state.batch)
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 1, generator=data)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
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
