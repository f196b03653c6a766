"""`save` and `load`: checkpoints in host memory for scripts that keep their own state (torchrun/DDP scripts).

A torchrun script saves with `torch.save` on rank 0 and loads at start. Here:

    from libworker import checkpoint
    state = checkpoint.load()                 # after init_process_group; None at the job's start
    ...
    checkpoint.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})

`save(obj)` is called on every rank; one process per host (the round's snapshot writer) copies `obj` (nested
dicts, lists and tuples of tensors and picklable values) into its host's snapshot, which the agent owns in shared
memory, so it outlives the process. That is the same snapshot `State.commit()` writes, copied to
`--checkpoint-dir` by the agent when the job has one. Each save is numbered one past the newest the job holds.

`load()` returns the newest object saved in the job, the same on every rank: each rank reads its host's newest
snapshot (or `--checkpoint-dir`'s newest checkpoint), the ranks agree in one allreduce on the newest and the lowest
rank holding it, and that rank broadcasts it when some rank lacks it (a new host, a host whose snapshot was lost).
It needs the default process group when the job has more than one process (call it after
`init_process_group()`, on every rank). Outside an elastic job (no agent: plain `torchrun`) `save` does nothing
and `load` returns None, so a script can keep its own files beside them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.snapshot.layout import buffer_paths, read_header
from libworker.elastic import snapshots

_last_saved = 0


def save(obj: Any) -> int:
    """Save `obj` as the job's newest checkpoint; returns its number (0 outside an elastic job)."""
    global _last_saved
    prefix = os.environ.get(WorkerEnv.SNAPSHOT)
    if not prefix:
        return 0
    _last_saved = max(_last_saved, _newest_on_host(prefix)) + 1
    out = snapshots.writer()
    if out is not None:
        out.write(_last_saved, {"checkpoint": obj})
    return _last_saved


def load() -> Any:
    """The newest object `save` saved in this job (or its `--checkpoint-dir`), the same on every rank; None when
    none was saved."""
    global _last_saved
    found = (
        snapshots.restorable()
        if os.environ.get(WorkerEnv.SNAPSHOT) or os.environ.get(WorkerEnv.CHECKPOINT_DIR)
        else None
    )
    number, obj = (
        (found.commit, found.tree.get("checkpoint"))
        if found is not None and isinstance(found.tree, dict)
        else (0, None)
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        number, obj = _agree(number, obj)
    _last_saved = max(_last_saved, number)
    return obj


def _agree(number: int, obj: Any) -> tuple[int, Any]:
    """The newest checkpoint any rank holds, from the lowest rank holding it, broadcast when some rank lacks it."""
    size, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    agreed = torch.tensor([number * (size + 1) + (size - rank), -number], dtype=torch.int64, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    newest, root, oldest = int(agreed[0]) // (size + 1), size - int(agreed[0]) % (size + 1), -int(agreed[1])
    if oldest == newest:
        return number, obj
    carried = [obj if rank == root else None]
    dist.broadcast_object_list(carried, src=root)
    return newest, carried[0]


def _newest_on_host(prefix: str) -> int:
    """The number of the newest checkpoint of this job in the host's snapshot (0: none)."""
    job = os.environ.get(WorkerEnv.JOB_KEY, "")
    headers = [h for h in map(read_header, buffer_paths(prefix)) if h is not None and h.job == job]
    return max((h.commit for h in headers), default=0)
