"""Horovod's helper functions (`horovod.torch.functions`): broadcast a model's parameters or an optimizer's state,
and send or gather picklable objects."""

from __future__ import annotations

from typing import Any

import cloudpickle
import torch

from libworker.mpi_ops import ProcessSet, allgather, broadcast_, broadcast_async_, global_process_set, synchronize
from libworker.world import require_joined


def broadcast_parameters(params: Any, root_rank: int, prefix: str | None = None) -> None:
    """Overwrite `params` (a state_dict, named_parameters(), parameters() or a list of tensors) with root_rank's
    values, in place; all broadcasts are submitted before the first is waited for, so one negotiation covers them."""
    if isinstance(params, dict):
        tensors = [p for _, p in sorted(params.items())]
    elif isinstance(params, (list, tuple)) or hasattr(params, "__iter__"):
        tensors = [p[1] if isinstance(p, tuple) else p for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}")
    handles = [
        broadcast_async_(t.data if isinstance(t, torch.nn.Parameter) else t, root_rank)
        for t in tensors
        if isinstance(t, torch.Tensor)
    ]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: torch.nn.Module | None = None
) -> None:
    """Make every rank's optimizer state (per-parameter buffers and hyper-parameters) root_rank's.

    A fresh optimizer has no state yet; like Horovod, the state is first
    created by a zero-gradient step of the wrapped optimizer, so every rank
    has the same buffers to overwrite.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        _initialise_state(optimizer)
    state = optimizer.state_dict()
    tensors = {
        (pid, key): value
        for pid, entry in state["state"].items()
        for key, value in entry.items()
        if isinstance(value, torch.Tensor)
    }
    scalars = {
        "groups": [{k: v for k, v in group.items() if k != "params"} for group in state["param_groups"]],
        "state": {
            pid: {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}
            for pid, entry in state["state"].items()
        },
    }
    scalars = broadcast_object(scalars, root_rank)
    broadcast_parameters([tensors[key] for key in sorted(tensors, key=str)], root_rank)
    for group, options in zip(state["param_groups"], scalars["groups"]):
        group.update(options)
    for pid, entry in scalars["state"].items():
        state["state"].setdefault(pid, {}).update(entry)
    optimizer.load_state_dict(state)


def _initialise_state(optimizer: torch.optim.Optimizer) -> None:
    """As Horovod: every parameter that trains gets a zero gradient (sparse for SparseAdam), kept afterwards, and the
    wrapped optimizer takes one local step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam):
                    p.grad = p.grad.to_sparse()
    getattr(optimizer, "local_step", optimizer.step)()


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: ProcessSet = global_process_set
) -> Any:
    """Send a picklable object from `root_rank` to every rank; returns it everywhere."""
    is_root = int(require_joined()["rank"]) == root_rank
    payload = (
        torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
        if is_root
        else torch.empty(0, dtype=torch.uint8)
    )
    length = torch.tensor([payload.numel()], dtype=torch.int64)
    broadcast_(length, root_rank, process_set=process_set)
    if not is_root:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, process_set=process_set)
    return obj if is_root else cloudpickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Every rank's object, in rank order."""
    payload = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64), process_set=process_set).tolist()
    data = allgather(payload, process_set=process_set)
    out, start = [], 0
    for n in lengths:
        out.append(cloudpickle.loads(data[start : start + n].numpy().tobytes()))
        start += n
    return out
