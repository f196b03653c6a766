"""The worker's place in the round and what this build can do: Horovod's `init`, `rank`, `size`, ... and the
`*_built` / `*_enabled` introspection, answered truthfully for torch.distributed under libworker."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from libworker.errors import WorkerInternalError
from libworker.process_sets import register
from libworker.world import enter_next_round, require_joined, world


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the current round (blocks until every slot of the round has joined). `process_sets`: ProcessSet objects
    (or lists of ranks) to register; their groups are built at every join. Horovod's `comm` (MPI) is refused."""
    if comm is not None:
        raise NotImplementedError("init(comm=...) needs MPI, which libworker does not use: call init() without it")
    if process_sets:
        register(process_sets if isinstance(process_sets, (list, tuple)) else [process_sets])
    world.shut_down = False
    if not world.slot:
        _enter_a_round()


def _enter_a_round() -> None:
    """Join a round, and the next one if this one fails while it forms (a peer died before the process group was
    up, and the control plane re-forms the job): what `@run` does after a reset, not a crash of this worker. A
    failure on the way to a round (no agent, the job gone) still raises."""
    while True:
        try:
            enter_next_round()
            return
        except WorkerInternalError:
            if not world.poisoned:
                raise


def shutdown() -> None:
    """Stop using libworker until the next init(): collectives and queries refuse until then. The worker stays in its
    round (its slot and process group are kept), so init() afterwards is immediate; the process's exit leaves it."""
    world.shut_down = True


def is_initialized() -> bool:
    return bool(world.slot) and not world.shut_down and dist.is_initialized()


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


def is_homogeneous() -> bool:
    """Every host of the round runs the same number of workers."""
    return size() == local_size() * cross_size()


def round_number() -> int:
    """The round this worker is in (1, 2, ...)."""
    return int(require_joined()["round"])


def host() -> str:
    return str(require_joined()["hostname"])


def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return dist.is_gloo_available()


def nccl_built() -> bool:
    return dist.is_nccl_available()


def cuda_built() -> bool:
    return torch.backends.cuda.is_built() and torch.version.hip is None


def rocm_built() -> bool:
    return torch.version.hip is not None


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotImplementedError("the Horovod timeline is not supported by libworker; use torch.profiler")


def stop_timeline() -> None:
    raise NotImplementedError("the Horovod timeline is not supported by libworker; use torch.profiler")
