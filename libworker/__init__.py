"""libworker: the worker side of elastic training, a drop-in for `horovod.torch.elastic` users.

    import libworker as elastic
    elastic.init()
    state = elastic.TorchState(model=model, optimizer=opt, sampler=sampler, epoch=0)

    @elastic.run
    def train(state): ...

It talks only to its host's agent; collectives run on torch.distributed.
"""

from __future__ import annotations

import torch.distributed as dist

from libworker.collectives import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
)
from libworker.elastic import run
from libworker.errors import HostsUpdatedInterrupt, WorkerInternalError
from libworker.sampler import ElasticSampler
from libworker.state import ObjectState, State, TorchState
from libworker.world import join, require_joined, world


def init() -> None:
    """Join the current round (blocks until every slot of the round has joined)."""
    if not world.slot:
        join()


def is_initialized() -> bool:
    return bool(world.slot) and dist.is_initialized()


def rank() -> int:
    return int(require_joined()["rank"])


def size() -> int:
    return int(require_joined()["size"])


def local_rank() -> int:
    return int(require_joined()["local_rank"])


def local_size() -> int:
    return int(require_joined()["local_size"])


def cross_rank() -> int:
    return int(require_joined()["cross_rank"])


def cross_size() -> int:
    return int(require_joined()["cross_size"])


def round_number() -> int:
    """The round this worker is in (1, 2, ...)."""
    return int(require_joined()["round"])


def host() -> str:
    return str(require_joined()["hostname"])


__all__ = [
    "ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "WorkerInternalError",
    "allgather", "allgather_object", "allreduce", "allreduce_", "barrier", "broadcast", "broadcast_",
    "broadcast_object", "cross_rank", "cross_size", "host", "init", "is_initialized", "local_rank",
    "local_size", "rank", "round_number", "run", "size",
]
