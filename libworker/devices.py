"""The worker's GPU: which CUDA device this process uses, and the torch.distributed backend that fits.

A worker started by an agent is bound to the GPU of its local rank, so a
script that also calls `torch.cuda.set_device(hvd.local_rank())` keeps
working. When the agent runs with `--share-gpus` (`ELASTIC_GPU_SHARED=1` in
the worker's environment) several workers use one GPU, round robin; NCCL
refuses two ranks on one GPU, so their CUDA tensors go through gloo. A host
without CUDA binds nothing and uses gloo. A standby binds its GPU only when
its agent admits it to a slot (until then it has no local rank).
"""

from __future__ import annotations

import os

import torch

from elastic_control_plane.bus.contract import WorkerEnv

CPU_BACKEND = "gloo"
GPU_BACKEND = "cpu:gloo,cuda:nccl"
SHARED_GPU_BACKEND = "cpu:gloo,cuda:gloo"


def gpus_shared() -> bool:
    """Whether this host's agent lets several workers share a GPU."""
    return os.environ.get(WorkerEnv.GPU_SHARED) == "1"


def device_index(local_rank: int, device_count: int, shared: bool) -> int:
    """The CUDA device of `local_rank`: its own, or round robin over the GPUs when they are shared."""
    if shared:
        return local_rank % device_count
    if local_rank >= device_count:
        raise RuntimeError(
            f"local rank {local_rank} has no GPU of its own: this host has {device_count} GPU(s); "
            "lower the agent's --slots or start it with --share-gpus"
        )
    return local_rank


def is_standby() -> bool:
    """Whether this process is a standby still waiting for a slot."""
    return os.environ.get(WorkerEnv.STANDBY) == "1"


def bind_device() -> None:
    """Make this worker's GPU the current CUDA device; nothing outside an agent's worker or without CUDA."""
    if not os.environ.get(WorkerEnv.AGENT) or is_standby() or not torch.cuda.is_available():
        return
    local_rank = int(os.environ.get(WorkerEnv.LOCAL_RANK, "0"))
    torch.cuda.set_device(device_index(local_rank, torch.cuda.device_count(), gpus_shared()))


def backend() -> str:
    """The backend string for `torch.distributed.init_process_group` on this host."""
    if not torch.cuda.is_available():
        return CPU_BACKEND
    return SHARED_GPU_BACKEND if gpus_shared() else GPU_BACKEND
