"""Horovod's `horovod.torch.mpi_ops` module path: every collective of Horovod's torch API, importable from here.

Same names, arguments and results as Horovod: reduce ops as constants
(`Average`, `Sum`, `Adasum`, `Min`, `Max`, `Product`; the strings "mean",
"sum", ... still work), `name=`, `prescale_factor`/`postscale_factor`,
`compression=`, `process_set=`, and the deprecated `average=`. The code lives
where its job is: the ops and how a reduction runs in libworker.reduction,
the asynchronous and in-place collectives in libworker.async_ops, the
differentiable out-of-place ones in libworker.differentiable, handles
(`poll`, `synchronize`) and `join` in libworker.handles, process sets in
libworker.process_sets. A dead peer or an abort of the round makes any of
them raise WorkerInternalError (Horovod's HorovodInternalError).
"""

from __future__ import annotations

from libworker.async_ops import (
    allgather_async,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    reducescatter_async,
    sparse_allreduce_async,
)
from libworker.differentiable import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from libworker.handles import join, poll, synchronize
from libworker.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from libworker.reduction import Adasum, Average, Max, Min, Product, Sum

__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
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
    "global_process_set",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "sparse_allreduce_async",
    "synchronize",
]
