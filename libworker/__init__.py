"""libworker: the worker side of elastic training, and a drop-in for `horovod.torch`.

    import libworker as hvd                  # or: import libworker as elastic
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, epoch=0)

    @hvd.elastic.run
    def train(state): ...

It talks only to its host's agent; collectives run on torch.distributed over the
round's process group (gloo on CPU, NCCL for CUDA tensors), through an
abortable core, so a dead peer raises WorkerInternalError (HorovodInternalError)
instead of hanging. The names below are Horovod's torch API; `elastic.*` names
(`run`, `TorchState`, ...) are also here at the top level. Importing it in a
worker binds the process to the GPU of its local rank (libworker.devices).
"""

from __future__ import annotations

from libworker import elastic
from libworker.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    host,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    round_number,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from libworker.compression import Compression
from libworker.devices import bind_device
from libworker.elastic import ElasticSampler, ObjectState, State, TorchState, run
from libworker.errors import CollectiveMismatchError, HorovodInternalError, HostsUpdatedInterrupt, WorkerInternalError
from libworker.functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from libworker.mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    global_process_set,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    sparse_allreduce_async,
    synchronize,
)
from libworker.optimizer import DistributedOptimizer
from libworker.sync_batch_norm import SyncBatchNorm

bind_device()

__all__ = [
    "Adasum",
    "Average",
    "CollectiveMismatchError",
    "Compression",
    "DistributedOptimizer",
    "ElasticSampler",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ObjectState",
    "ProcessSet",
    "Product",
    "State",
    "Sum",
    "SyncBatchNorm",
    "TorchState",
    "WorkerInternalError",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "gloo_built",
    "gloo_enabled",
    "global_process_set",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "host",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "round_number",
    "run",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
