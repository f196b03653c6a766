"""A DDP script written for torchrun, the way PyTorch's DDP tutorial and torchrun's docs write it: the process group
from the environment, a checkpoint loaded at start (before the model is wrapped) and saved by rank 0 every few
steps. It runs unchanged under torchrun and under the elastic agents:

    torchrun --nproc-per-node 2 examples/ddp_train.py --checkpoint /tmp/ddp.pt
    elasticctl torchrun --nnodes 2 --nproc-per-node 2 examples/ddp_train.py --checkpoint /tmp/ddp.pt
    elasticctl local --hosts 2 --slots 2 --mode torchrun -- python examples/ddp_train.py --checkpoint /tmp/ddp.pt

`--fsdp` shards the model with FSDP (`fully_shard`, on gloo too) instead of DDP; its checkpoint holds full state
dicts (`torch.distributed.checkpoint.state_dict`), loaded after sharding. `--host-memory` keeps the checkpoint in
the host's memory instead of a file (libworker.checkpoint: every rank calls save and load; under plain torchrun
it saves nothing). `--log-dir DIR` writes one JSON line per step and
per start from every rank (the tests and benchmarks read them). At the end every rank checks that all hold
identical parameters; the script exits 3 if they differ.
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
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from train import make_data, make_model, tensors_checksum

FULL = StateDictOptions(full_state_dict=True)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def state_dicts(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and optimizer's full state dicts (with FSDP a collective: every rank calls it)."""
    return get_state_dict(model, optimizer, options=FULL) if fsdp else (model.state_dict(), optimizer.state_dict())


def checksum(model: torch.nn.Module, optimizer: torch.optim.Optimizer, fsdp: bool) -> torch.Tensor:
    return tensors_checksum(state_dicts(model, optimizer, fsdp)[0].values())


def load_snapshot(args: argparse.Namespace) -> dict[str, Any] | None:
    if args.host_memory:
        from libworker import checkpoint

        return checkpoint.load()
    if args.checkpoint and os.path.exists(args.checkpoint):
        return torch.load(args.checkpoint, map_location="cpu", weights_only=True)
    return None


def save_snapshot(args: argparse.Namespace, snapshot: dict[str, Any]) -> None:
    if args.host_memory:
        from libworker import checkpoint

        checkpoint.save(snapshot)
    elif args.checkpoint and dist.get_rank() == 0:
        partial = f"{args.checkpoint}.partial"
        torch.save(snapshot, partial)
        os.replace(partial, args.checkpoint)


class StepLog:
    def __init__(self, directory: str | None) -> None:
        self.file = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(directory) / f"ddp-{os.getpid()}.jsonl", "a")

    def write(self, event: str, **fields: Any) -> None:
        if self.file is not None:
            record = {
                "event": event,
                "time": time.time(),
                "pid": os.getpid(),
                "rank": dist.get_rank(),
                "size": dist.get_world_size(),
                "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                **fields,
            }
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument(
        "--step-delay", type=float, default=0.0, help="Seconds to sleep per step (a slower job for tests)."
    )
    parser.add_argument(
        "--checkpoint", default=None, help="Checkpoint file (rank 0 writes it; every rank reads it at start)."
    )
    parser.add_argument(
        "--host-memory", action="store_true", help="Keep the checkpoint in host memory (libworker.checkpoint)."
    )
    parser.add_argument(
        "--fsdp", action="store_true", help="Shard the model with FSDP instead of replicating it with DDP."
    )
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    log = StepLog(args.log_dir)

    model = make_model().to(device)
    if args.fsdp:
        model = shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start_step = 0
    snapshot = load_snapshot(args)
    if snapshot is not None and args.fsdp:
        set_state_dict(
            model, optimizer, model_state_dict=snapshot["model"], optim_state_dict=snapshot["optimizer"], options=FULL
        )
    elif snapshot is not None:
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
    if snapshot is not None:
        start_step = int(snapshot["step"])
    trained = model if args.fsdp else DDP(model, device_ids=[local_rank] if use_cuda else None)
    log.write("start", step=start_step, checksum=checksum(model, optimizer, args.fsdp).tolist())
    if rank == 0:
        print(
            f"training on {world_size} workers from step {start_step} (restart "
            f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})",
            flush=True,
        )

    x, y = make_data(args.samples)
    loss_fn = torch.nn.MSELoss()
    for step in range(start_step, args.steps):
        order = torch.randperm(args.samples, generator=torch.Generator().manual_seed(step))
        batch = order[: args.batch_size * world_size][rank::world_size]
        optimizer.zero_grad()
        loss = loss_fn(trained(x[batch].to(device)), y[batch].to(device))
        loss.backward()
        optimizer.step()
        log.write("step", step=step + 1, loss=loss.item())
        if (step + 1) % args.save_every == 0:
            model_state, optimizer_state = state_dicts(model, optimizer, args.fsdp)
            save_snapshot(args, {"model": model_state, "optimizer": optimizer_state, "step": step + 1})
            log.write("saved", step=step + 1)
        if args.step_delay:
            time.sleep(args.step_delay)

    checksums = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world_size)]
    dist.all_gather(checksums, checksum(model, optimizer, args.fsdp).to(device))
    identical = all(torch.equal(c, checksums[0]) for c in checksums)
    if rank == 0:
        print(f"parameters identical on all {world_size} ranks: {identical}", flush=True)
    # The DDP wrapper goes before its process group, and a barrier lets gloo's threads drop the last collective:
    # torch 2.13 can deadlock at the end otherwise (the group's destructor, run by the wrapper's with the GIL held,
    # joins a gloo thread that needs the GIL to free the all_gather's tensors).
    del trained
    dist.barrier()
    dist.destroy_process_group()
    return 0 if identical else 3


if __name__ == "__main__":
    sys.exit(main())
