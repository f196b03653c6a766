"""Horovod's torch API surface on libworker (names, module paths, refusals with clear errors) and the optimizer's
bucket layout, on a one-rank world."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist

import libworker as hvd
from libworker.optimizer import explicit_groups, fusion_threshold, layout_buckets
from libworker.world import world

HOROVOD_TORCH_NAMES = """
elastic Compression allgather_object broadcast_object broadcast_optimizer_state broadcast_parameters allreduce
allreduce_async allreduce_ allreduce_async_ grouped_allreduce grouped_allreduce_async grouped_allreduce_
grouped_allreduce_async_ sparse_allreduce_async allgather allgather_async grouped_allgather grouped_allgather_async
broadcast broadcast_async broadcast_ broadcast_async_ alltoall alltoall_async reducescatter reducescatter_async
grouped_reducescatter grouped_reducescatter_async join barrier poll synchronize init shutdown is_initialized
start_timeline stop_timeline size local_size cross_size rank local_rank cross_rank mpi_threads_supported mpi_enabled
mpi_built gloo_enabled gloo_built nccl_built ddl_built ccl_built cuda_built rocm_built ProcessSet global_process_set
add_process_set remove_process_set Average Sum Adasum Min Max Product HorovodInternalError DistributedOptimizer
SyncBatchNorm
""".split()

MODULE_PATHS = {
    "libworker.mpi_ops": ["allreduce", "synchronize", "Average", "Adasum", "global_process_set"],
    "libworker.functions": [
        "broadcast_parameters",
        "broadcast_optimizer_state",
        "broadcast_object",
        "allgather_object",
    ],
    "libworker.compression": ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"],
    "libworker.optimizer": ["DistributedOptimizer"],
    "libworker.elastic": ["run", "State", "ObjectState", "TorchState", "ElasticSampler"],
    "libworker.elastic.state": ["TorchState", "ObjectState", "State"],
    "libworker.elastic.sampler": ["ElasticSampler"],
    "libworker.sync_batch_norm": ["SyncBatchNorm"],
}


def test_every_public_name_of_horovod_torch_is_here() -> None:
    assert [name for name in HOROVOD_TORCH_NAMES if not hasattr(hvd, name)] == []


@pytest.mark.parametrize("module", sorted(MODULE_PATHS))
def test_horovods_module_paths_exist(module: str) -> None:
    imported = importlib.import_module(module)
    assert [name for name in MODULE_PATHS[module] if not hasattr(imported, name)] == []


def test_horovod_exception_names_are_ours() -> None:
    assert hvd.HorovodInternalError is hvd.WorkerInternalError
    assert hvd.elastic.TorchState is hvd.TorchState


def test_build_introspection_answers_for_torch_distributed() -> None:
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert not hvd.mpi_built() and not hvd.mpi_enabled() and not hvd.mpi_threads_supported()
    assert hvd.nccl_built() == dist.is_nccl_available()
    assert not hvd.ddl_built() and not hvd.ccl_built()
    assert hvd.rocm_built() == (torch.version.hip is not None)


def test_a_process_set_must_be_registered_before_use(one_rank_world: None) -> None:
    with pytest.raises(ValueError, match="is not registered"):
        hvd.allreduce(torch.ones(2), process_set=hvd.ProcessSet([0]))
    with pytest.raises(ValueError, match="must be ranks of this round"):
        hvd.add_process_set([0, 5])


def test_what_is_not_supported_says_so(one_rank_world: None) -> None:
    with pytest.raises(NotImplementedError, match="needs MPI"):
        hvd.init(comm=[0])
    with pytest.raises(NotImplementedError, match="timeline"):
        hvd.start_timeline("/tmp/timeline.json")
    with pytest.raises(NotImplementedError, match="SyncBatchNorm"):
        hvd.SyncBatchNorm(4)


def test_reduce_op_arguments_follow_horovod(one_rank_world: None) -> None:
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(torch.ones(2), average=True, op=hvd.Sum)
    with pytest.raises(ValueError, match="unknown reduce op"):
        hvd.allreduce(torch.ones(2), op="median")
    with pytest.warns(DeprecationWarning):
        hvd.allreduce(torch.ones(2), average=False)
    assert torch.equal(hvd.allreduce(torch.ones(2), "sum"), torch.ones(2))
    with pytest.raises(ValueError, match="root_rank 3"):
        hvd.broadcast(torch.ones(2), root_rank=3)


def test_a_handle_of_an_earlier_round_raises(one_rank_world: None, monkeypatch: pytest.MonkeyPatch) -> None:
    handle = hvd.allreduce_async(torch.ones(3), op=hvd.Sum)
    monkeypatch.setattr(world, "round", 2)
    with pytest.raises(hvd.HorovodInternalError, match="round 1"):
        hvd.synchronize(handle)
    assert hvd.synchronize(handle) is None


def test_async_handles_poll_and_synchronize(one_rank_world: None) -> None:
    handle = hvd.allreduce_async(torch.full((4,), 2.0), name="grad.w", prescale_factor=3.0, postscale_factor=0.5)
    assert hvd.poll(handle) in (True, False)
    assert torch.equal(hvd.synchronize(handle), torch.full((4,), 3.0))
    with pytest.raises(ValueError, match="unknown handle"):
        hvd.poll(handle)


def test_shutdown_then_init_in_the_same_process(one_rank_world: None) -> None:
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(RuntimeError, match="shut down"):
        hvd.rank()
    hvd.init()
    assert hvd.is_initialized() and hvd.rank() == 0 and hvd.size() == 1


def _params(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    return [torch.zeros(shape, dtype=dtype, requires_grad=True) for shape in shapes]


def _index(params: list[torch.Tensor], p: torch.Tensor) -> int:
    return next(i for i, q in enumerate(params) if q is p)


def test_buckets_run_in_reverse_order_with_a_small_first_bucket() -> None:
    params = _params((1 << 17,), (1 << 17,), (1 << 17,), (1 << 17,), (1 << 17,), (1 << 17,))  # 512 KiB each
    buckets = layout_buckets(params, threshold=2 << 20)
    assert [[_index(params, p) for p in bucket] for bucket in buckets] == [[5, 4], [3, 2, 1, 0]]


def test_a_bucket_closes_with_the_gradient_that_reaches_its_cap_as_in_ddp() -> None:
    params = _params((300,), (300,), (300,), (300,), (300,))  # 1200 bytes each
    buckets = layout_buckets(params, threshold=2000, first_bytes=1000)
    assert [[_index(params, p) for p in bucket] for bucket in buckets] == [[4], [3, 2], [1, 0]]


def test_buckets_split_by_dtype_and_a_big_tensor_closes_its_bucket() -> None:
    params = _params((10,), (10,)) + _params((10,), dtype=torch.float64) + _params((1000,))
    buckets = layout_buckets(params, threshold=200, first_bytes=200)
    assert [[_index(params, p) for p in bucket] for bucket in buckets] == [[3], [2], [1, 0]]


def test_fusion_threshold_zero_gives_one_bucket_per_parameter() -> None:
    params = _params((3,), (4,), (5,))
    assert len(layout_buckets(params, threshold=0)) == 3


def test_explicit_groups_follow_horovod() -> None:
    params = _params((1,), (2,), (3,), (4,), (5,))
    assert [len(g) for g in explicit_groups(params, 2)] == [3, 2]
    listed = explicit_groups(params, [[params[0], params[4]]])
    assert [[_index(params, p) for p in g] for g in listed] == [[0, 4], [1], [2], [3]]
    with pytest.raises(ValueError, match="only appear once"):
        explicit_groups(params, [[params[0]], [params[0]]])


def test_fusion_threshold_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ELASTIC_FUSION_THRESHOLD", raising=False)
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1048576")
    assert fusion_threshold() == 1 << 20
    monkeypatch.setenv("ELASTIC_FUSION_THRESHOLD", "lots")
    with pytest.raises(ValueError, match="ELASTIC_FUSION_THRESHOLD='lots'"):
        fusion_threshold()


def test_distributed_optimizer_refuses_bad_arguments(one_rank_world: None) -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=0)
    with pytest.raises(ValueError, match="gradient_predivide_factor not supported with op != Average"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="must be unique"):
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[("w", model.weight), ("w", model.bias)]
        )
    with pytest.raises(ValueError, match="were not named"):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=[("w", model.weight)])


def test_distributed_optimizer_is_the_wrapped_optimizer_and_restores_after_a_failed_step(one_rank_world: None) -> None:
    model = torch.nn.Linear(2, 1)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), named_parameters=model.named_parameters()
    )
    assert isinstance(optimizer, torch.optim.SGD)
    state = hvd.elastic.TorchState(model, optimizer, batch=0)
    model(torch.ones(1, 2)).sum().backward()
    with pytest.raises(AssertionError, match="zero_grad"):
        optimizer.zero_grad()
    state.restore()
    optimizer.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert optimizer.state_dict()["state"]
