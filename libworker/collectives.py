"""Collectives on torch.distributed (gloo on CPU, NCCL for CUDA tensors) that never hang a survivor.

Every operation is issued asynchronously; the caller waits for it or for an
abort of the round (the control plane learnt of a failure), or for the
collective timeout, whichever comes first. Any transport error, abort or
timeout raises WorkerInternalError, and marks the process group as abandoned.
"""

from __future__ import annotations

import threading
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from libworker.errors import WorkerInternalError
from libworker.world import require_joined, world

OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "average": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}


def _fail(reason: str) -> WorkerInternalError:
    world.poisoned = True
    return WorkerInternalError(f"round {world.round}: {reason}")


def _wait(issue: Any) -> None:
    """Issue an async collective (a callable returning a Work) and wait for it, an abort, or the timeout."""
    require_joined()
    if world.aborted_round == world.round:
        raise _fail("aborted by the control plane")
    wake = threading.Event()
    with world.lock:
        world.waiters.add(wake)
    try:
        try:
            work = issue()
        except (RuntimeError, dist.DistError) as exc:
            raise _fail(f"collective failed: {exc}") from None
        work.get_future().add_done_callback(lambda _: wake.set())
        finished = wake.wait(world.timing.collective_timeout + 5.0)
        if world.aborted_round == world.round:
            raise _fail("aborted by the control plane (a peer failed)")
        if not finished:
            raise _fail(f"collective did not finish within {world.timing.collective_timeout:g}s")
        try:
            work.wait()
        except (RuntimeError, dist.DistError) as exc:
            raise _fail(f"collective failed: {exc}") from None
    finally:
        with world.lock:
            world.waiters.discard(wake)


def allreduce_(tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
    """Reduce `tensor` in place across all ranks. op: mean (Horovod's default), sum, max, min, product."""
    if op not in OPS:
        raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(OPS)}")
    _wait(lambda: dist.all_reduce(tensor, op=OPS[op], async_op=True))
    if op in ("mean", "average"):
        tensor.div_(dist.get_world_size())
    return tensor


def allreduce(tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
    return allreduce_(tensor.clone(), op)


def broadcast_(tensor: torch.Tensor, root_rank: int = 0) -> torch.Tensor:
    _wait(lambda: dist.broadcast(tensor, src=root_rank, async_op=True))
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int = 0) -> torch.Tensor:
    return broadcast_(tensor.clone(), root_rank)


def allgather(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ, as in Horovod)."""
    tensor = tensor if tensor.dim() > 0 else tensor.reshape(1)
    sizes = torch.zeros(dist.get_world_size(), dtype=torch.int64)
    sizes[dist.get_rank()] = tensor.shape[0]
    allreduce_(sizes, "sum")
    longest = int(sizes.max())
    padded = torch.zeros((longest, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    padded[: tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    _wait(lambda: dist.all_gather(parts, padded, async_op=True))
    return torch.cat([part[: int(n)] for part, n in zip(parts, sizes)])


def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """Send a picklable object from `root_rank` to every rank; returns it everywhere."""
    if dist.get_rank() == root_rank:
        payload = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank)
    if dist.get_rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank)
    return obj if dist.get_rank() == root_rank else cloudpickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any) -> list[Any]:
    """Every rank's object, in rank order."""
    payload = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64))
    data = allgather(payload)
    out, start = [], 0
    for n in lengths.tolist():
        out.append(cloudpickle.loads(data[start : start + n].numpy().tobytes()))
        start += n
    return out


def barrier() -> None:
    allreduce_(torch.zeros(1), "sum")
