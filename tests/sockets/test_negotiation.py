"""Every rank agrees on every collective: real gloo ranks (2 and 3) running programs with the mistakes users make.

- Each kind of mismatch (shape, rank of shape, dtype, op, root, scale factors, operation kind, allgather's
  trailing dims) raises CollectiveMismatchError (a RuntimeError) on every rank, naming the field and each rank's
  value, and the next collective on the same group gives the right answer.
- Ops submitted in different orders on different ranks are matched by name, as in Horovod; a duplicate name in
  flight raises ValueError on the rank that submitted it.
- Every dtype Horovod supports on every op, against a single-process reference (int16 included, which gloo lacks;
  integer tensors with scale factors follow Horovod's float64 arithmetic).
- join(): uneven data under DistributedOptimizer (a rank that ran out of batches joins, the others go on), the
  joined rank's zeros in the others' allreduces, the last rank to join returned everywhere; allgather while a
  rank is joined fails as Horovod's does.
- A process set of the even ranks runs its own collectives with its own negotiation; a DistributedOptimizer on it
  averages over its members, and a rank outside it steps on its own gradients.
- Gradients flow back through allreduce, allgather and broadcast as Horovod's; a sparse gradient is reduced and
  handed back sparse (SparseAdam); sparse_allreduce_async's handle can be called.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from testing.ranks import run_ranks

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64", "bool"]


def _value(dtype: str, rank: int, shape: tuple[int, ...] = (3, 4)) -> torch.Tensor:
    """A deterministic tensor per rank, small enough that sums and products stay exact in every dtype."""
    base = torch.arange(int(np.prod(shape)), dtype=torch.int64).reshape(shape)
    values = (base * 7 + rank * 3) % 5 + (1 if dtype != "bool" else 0)
    if dtype == "bool":
        return ((base + rank) % 2 == 0).reshape(shape)
    return values.to(getattr(torch, dtype))


def _mismatch_body() -> dict[str, Any]:
    import libworker as hvd

    rank = hvd.rank()
    outcomes: dict[str, Any] = {}

    def attempt(label: str, call: Any) -> None:
        try:
            call()
            outcomes[label] = "nothing raised"
        except RuntimeError as exc:
            outcomes[label] = f"{type(exc).__name__}: {exc}"
        after = hvd.allreduce(torch.ones(5) * (rank + 1), op=hvd.Sum, name=f"after.{label}")
        outcomes[f"{label}.next"] = after.tolist()

    attempt("shape", lambda: hvd.allreduce(torch.ones([17 + rank] * 2)))
    attempt("ndim", lambda: hvd.allreduce(torch.ones([17, 23 * 57] if rank == 0 else [17, 23, 57])))
    attempt("dtype", lambda: hvd.allreduce(torch.ones(4, dtype=torch.int32 if rank % 2 == 0 else torch.float32)))
    attempt("op", lambda: hvd.allreduce(torch.ones(4), op=hvd.Sum if rank == 0 else hvd.Max))
    attempt("root", lambda: hvd.broadcast(torch.ones(4), root_rank=rank))
    attempt("scale", lambda: hvd.allreduce(torch.ones(4), prescale_factor=1.0 + rank))
    attempt("kind", lambda: hvd.allreduce(torch.ones(4)) if rank == 0 else hvd.allgather(torch.ones(4)))
    attempt("allgather", lambda: hvd.allgather(torch.ones(2, 10 * (rank + 1))))
    attempt("reducescatter", lambda: hvd.reducescatter(torch.ones(6, 2 + rank)))
    attempt("grouped", lambda: hvd.grouped_allreduce([torch.ones(3), torch.ones(2 + rank)]))
    outcomes["is_runtime_error"] = issubclass(hvd.CollectiveMismatchError, RuntimeError)
    outcomes["not_internal"] = not issubclass(hvd.CollectiveMismatchError, hvd.HorovodInternalError)
    return outcomes


@pytest.mark.parametrize("size", [2, 3])
def test_a_mismatch_raises_on_every_rank_and_the_next_collective_works(size: int) -> None:
    outcomes = run_ranks(size, _mismatch_body)
    expected_next = [float(sum(range(1, size + 1)))] * 5
    labels = ["shape", "ndim", "dtype", "op", "root", "scale", "kind", "allgather", "reducescatter", "grouped"]
    for rank, out in enumerate(outcomes):
        assert out["is_runtime_error"] and out["not_internal"]
        for label in labels:
            assert out[label].startswith("CollectiveMismatchError: Mismatched"), (rank, label, out[label])
            assert out[f"{label}.next"] == expected_next, (rank, label)
    first = outcomes[0]
    assert first["shape"] == (
        "CollectiveMismatchError: Mismatched allreduce tensor shapes: rank 0 has [17, 17], rank 1 has [18, 18]"
        + (", rank 2 has [19, 19]" if size == 3 else "")
    )
    assert "data types" in first["dtype"] and "int32" in first["dtype"] and "float32" in first["dtype"]
    assert "reduction operation" in first["op"] and "Sum" in first["op"] and "Max" in first["op"]
    assert "root ranks" in first["root"]
    assert "prescale and/or postscale factors" in first["scale"]
    assert "operations" in first["kind"] and "allgather" in first["kind"]
    assert "(after the first dimension)" in first["allgather"]
    assert all(out["shape"] == first["shape"] for out in outcomes), "every rank names the same mismatch"


def _order_body() -> dict[str, Any]:
    import libworker as hvd

    rank = hvd.rank()
    a, b = torch.full((3,), float(rank + 1)), torch.full((5,), 10.0 * (rank + 1))
    names = ["a", "b"] if rank == 0 else ["b", "a"]
    handles = {name: hvd.allreduce_async(a if name == "a" else b, name=name, op=hvd.Sum) for name in names}
    result = {name: hvd.synchronize(handles[name]).tolist() for name in reversed(names)}
    duplicate = "nothing raised"
    pending = hvd.allreduce_async(a, name="twice")
    try:
        hvd.allreduce_async(a, name="twice")
    except ValueError as exc:
        duplicate = str(exc)
    hvd.synchronize(pending)
    return {"result": result, "duplicate": duplicate}


def test_ops_submitted_in_different_orders_match_by_name() -> None:
    outcomes = run_ranks(2, _order_body)
    for out in outcomes:
        assert out["result"] == {"a": [3.0] * 3, "b": [30.0] * 5}
        assert "same name" in out["duplicate"]


def _dtypes_body(dtypes: list[str]) -> dict[str, Any]:
    import libworker as hvd

    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    for dtype in dtypes:
        mine = _value(dtype, rank)
        ops = {"sum": hvd.Sum, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}
        if dtype != "bool":
            ops["average"] = hvd.Average
        for label, op in ops.items():
            out[f"{dtype}/allreduce/{label}"] = _numpy(hvd.allreduce(mine, op=op))
        out[f"{dtype}/broadcast"] = _numpy(hvd.broadcast(mine, root_rank=size - 1))
        out[f"{dtype}/allgather"] = _numpy(hvd.allgather(mine[: rank + 1]))
        out[f"{dtype}/alltoall"] = _numpy(hvd.alltoall(_value(dtype, rank, (size * 2, 3))))
        if dtype != "bool":
            out[f"{dtype}/reducescatter"] = _numpy(hvd.reducescatter(_value(dtype, rank, (size * 2, 3)), op=hvd.Sum))
        if dtype in ("int32", "int64", "int16", "float16", "float32", "float64"):
            out[f"{dtype}/prescale"] = _numpy(hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.37))
            out[f"{dtype}/postscale"] = _numpy(hvd.allreduce(mine, op=hvd.Sum, postscale_factor=2.5))
        out[f"{dtype}/grouped"] = [
            _numpy(t) for t in hvd.grouped_allreduce([mine, _value(dtype, rank, (2,))], op=hvd.Max)
        ]
    return out


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Horovod's scaling: integers in float64, float16 on the CPU in float32, then back to the dtype."""
    if not tensor.dtype.is_floating_point:
        return (tensor.to(torch.float64) * factor).to(tensor.dtype)
    if tensor.dtype == torch.float16:
        return (tensor.float() * factor).to(torch.float16)
    return tensor * factor


def _reduced(values: list[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack([v.to(torch.int64) if v.dtype == torch.bool else v for v in values])
    dtype = values[0].dtype
    if dtype == torch.bool:
        return (stacked.amax(0) if op in ("sum", "max") else stacked.amin(0)).bool()
    if op == "sum":
        return stacked.sum(0).to(dtype)
    if op == "average":
        total = stacked.sum(0).to(dtype)
        return total / len(values) if dtype.is_floating_point else total.div(len(values), rounding_mode="trunc")
    if op == "min":
        return stacked.amin(0)
    if op == "max":
        return stacked.amax(0)
    return stacked.prod(0).to(dtype)


@pytest.mark.parametrize("size", [2, 3])
def test_every_dtype_on_every_op_matches_a_single_process_reference(size: int) -> None:
    outcomes = run_ranks(size, _dtypes_body, DTYPES, timeout=120)
    for dtype in DTYPES:
        values = [_value(dtype, rank) for rank in range(size)]
        tol = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-6, "float64": 1e-12}.get(dtype, 0)
        for rank, out in enumerate(outcomes):
            for op in ("sum", "min", "max", "product") + (("average",) if dtype != "bool" else ()):
                np.testing.assert_allclose(
                    out[f"{dtype}/allreduce/{op}"].astype(np.float64),
                    _numpy(_reduced(values, op)).astype(np.float64),
                    rtol=tol,
                    err_msg=f"{dtype} {op} rank {rank}",
                )
            np.testing.assert_array_equal(out[f"{dtype}/broadcast"], _numpy(values[-1]))
            np.testing.assert_array_equal(
                out[f"{dtype}/allgather"], _numpy(torch.cat([v[: r + 1] for r, v in enumerate(values)]))
            )
            rows = [_value(dtype, r, (size * 2, 3)) for r in range(size)]
            np.testing.assert_array_equal(
                out[f"{dtype}/alltoall"], _numpy(torch.cat([row[2 * rank : 2 * rank + 2] for row in rows]))
            )
            if dtype != "bool":
                np.testing.assert_allclose(
                    out[f"{dtype}/reducescatter"].astype(np.float64),
                    _numpy(_reduced(rows, "sum")[2 * rank : 2 * rank + 2]).astype(np.float64),
                    rtol=tol,
                )
            if f"{dtype}/prescale" in out:
                pre = _reduced([_scaled(v, 0.37) for v in values], "sum")
                post = _scaled(_reduced(values, "sum"), 2.5)
                np.testing.assert_allclose(
                    out[f"{dtype}/prescale"].astype(np.float64), _numpy(pre).astype(np.float64), rtol=tol
                )
                np.testing.assert_allclose(
                    out[f"{dtype}/postscale"].astype(np.float64), _numpy(post).astype(np.float64), rtol=tol
                )
            small = [_value(dtype, r, (2,)) for r in range(size)]
            np.testing.assert_array_equal(
                out[f"{dtype}/grouped"][1].astype(np.float64), _numpy(_reduced(small, "max")).astype(np.float64)
            )


def _users_own_compression() -> Any:
    """A compressor as a user writes one (lossless here): the library cannot know what it does to a value."""

    class PassThrough:
        @staticmethod
        def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, None]:
            return tensor.clone(), None

        @staticmethod
        def decompress(tensor: torch.Tensor, ctx: None) -> torch.Tensor:
            return tensor

    return PassThrough


def _join_body(batches_per_rank: list[int], users_compression: bool = False) -> dict[str, Any]:
    import torch.nn.functional as F

    import libworker as hvd

    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    compression = _users_own_compression() if users_compression else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=compression
    )
    for step in range(batches_per_rank[rank]):
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    last = hvd.join()
    gathered_while_joined = "nothing raised"
    if rank == 0:
        first = hvd.join()
    else:
        try:
            hvd.allgather(torch.ones(2))
        except RuntimeError as exc:
            gathered_while_joined = str(exc)
        first = hvd.join()
    return {
        "last": last,
        "first": first,
        "gathered_while_joined": gathered_while_joined,
        "params": [p.detach().numpy().copy() for p in model.parameters()],
    }


def _reference_join_training(batches_per_rank: list[int]) -> list[np.ndarray]:
    """The model of a rank that trains to the end: each step applies the average over all ranks of the gradients,
    a rank that has joined counting as zero (a joined rank's own model stops where it joined)."""
    import torch.nn.functional as F

    size = len(batches_per_rank)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(max(batches_per_rank)):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(size):
            if step >= batches_per_rank[rank]:
                continue
            generator = torch.Generator().manual_seed(1000 * rank + step)
            x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            for total, p in zip(grads, model.parameters()):
                total += p.grad
        for p, total in zip(model.parameters(), grads):
            p.grad = total / size
        optimizer.step()
    return [p.detach().numpy().copy() for p in model.parameters()]


@pytest.mark.parametrize(
    "batches_per_rank, users_compression",
    [
        ([3, 5], False),
        ([5, 2, 4], False),
        ([1, 3], False),
        ([4, 4], False),
        ([2, 2, 4], False),
        ([3, 5], True),
        ([5, 2, 4], True),  # steps agreed on one by one: the data cannot be trusted to count joins
    ],
)
def test_join_with_uneven_batches_under_distributed_optimizer(
    batches_per_rank: list[int], users_compression: bool
) -> None:
    size = len(batches_per_rank)
    outcomes = run_ranks(size, _join_body, batches_per_rank, users_compression, timeout=120)
    reference = _reference_join_training(batches_per_rank)
    last_to_join = max(range(size), key=lambda r: (batches_per_rank[r], r))
    for rank, out in enumerate(outcomes):
        assert out["last"] == last_to_join, (rank, out["last"])
        assert out["first"] != 0 and out["first"] == outcomes[0]["first"], "rank 0 joined first the second time"
        if batches_per_rank[rank] == max(batches_per_rank):
            for got, want in zip(out["params"], reference):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        if rank:
            assert out["gathered_while_joined"] == "Allgather is not supported with Join at this time."


def _metric_then_step_body(batches_per_rank: list[int]) -> dict[str, Any]:
    """Each iteration logs a metric (an allreduce) before its step: a rank that joins after its last step meets
    the others in the next metric's negotiation, not in a step."""
    import torch.nn.functional as F

    import libworker as hvd

    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    ranks_training = []
    for step in range(batches_per_rank[rank]):
        ranks_training.append(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="ranks_training").item())
        generator = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()
    return {
        "last": hvd.join(),
        "ranks_training": ranks_training,
        "params": [p.detach().numpy().copy() for p in model.parameters()],
    }


def test_a_rank_that_joins_serves_the_metric_the_others_log_before_their_next_step() -> None:
    outcomes = run_ranks(2, _metric_then_step_body, [2, 4], timeout=120)
    assert [out["last"] for out in outcomes] == [1, 1]
    assert outcomes[0]["ranks_training"] == [2.0, 2.0]
    assert outcomes[1]["ranks_training"] == [2.0, 2.0, 1.0, 1.0]
    for got, want in zip(outcomes[1]["params"], _reference_join_training([2, 4])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _collectives_per_step_body(op_name: str = "Average", users_compression: bool = False) -> list[int]:
    """How many allreduces each of 4 steps of a small model issues (one bucket)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import libworker as hvd

    issued = [0]
    all_reduce = dist.all_reduce

    def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
        issued[0] += 1
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    model = torch.nn.Linear(6, 2)
    compression = _users_own_compression() if users_compression else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        op=getattr(hvd, op_name),
        compression=compression,
    )
    per_step = []
    for _ in range(4):
        before = issued[0]
        optimizer.zero_grad()
        F.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 2)).backward()
        optimizer.step()
        per_step.append(issued[0] - before)
    return per_step


def test_a_step_after_the_first_of_a_round_sends_nothing_but_its_buckets() -> None:
    for per_step in run_ranks(2, _collectives_per_step_body):
        assert per_step[0] > 1, "the round's first step agrees on the layout before its bucket moves"
        assert per_step[1:] == [1, 1, 1]


def _process_set_body() -> dict[str, Any]:
    import libworker as hvd

    rank, size = hvd.rank(), hvd.size()
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = hvd.add_process_set([r for r in range(size) if r % 2 == 1])
    mine = evens if rank % 2 == 0 else odds
    summed = hvd.allreduce(torch.tensor([float(rank + 1)]), op=hvd.Sum, process_set=mine)
    gathered = hvd.allgather(torch.tensor([rank]), process_set=mine)
    mismatch = "nothing raised"
    try:
        hvd.allreduce(torch.ones(2 + mine.rank()), process_set=mine)
    except RuntimeError as exc:
        mismatch = type(exc).__name__
    whole = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)
    assert mine.rank_in(rank) == mine.rank() and evens.rank_in(1) is None
    return {
        "summed": summed.item(),
        "gathered": gathered.tolist(),
        "rank_in_set": mine.rank(),
        "set_size": mine.size(),
        "included": (evens.included(), odds.included()),
        "mismatch": mismatch,
        "whole": whole.item(),
    }


def test_process_sets_run_their_own_collectives() -> None:
    outcomes = run_ranks(3, _process_set_body)
    for rank, out in enumerate(outcomes):
        members = [r for r in range(3) if r % 2 == rank % 2]
        assert out["summed"] == sum(r + 1 for r in members)
        assert out["gathered"] == members
        assert out["rank_in_set"] == members.index(rank) and out["set_size"] == len(members)
        assert out["included"] == (rank % 2 == 0, rank % 2 == 1)
        assert out["whole"] == 3.0
        assert out["mismatch"] == ("CollectiveMismatchError" if len(members) > 1 else "nothing raised")


def _stall_body() -> dict[str, Any]:
    import dataclasses

    import libworker as hvd
    from libworker.world import world

    world.timing = dataclasses.replace(world.timing, collective_timeout=3.0)
    rank = hvd.rank()
    try:
        hvd.allreduce(torch.ones(2), name=f"only-on-rank-{rank}")
        stalled = "nothing raised"
    except hvd.CollectiveMismatchError as exc:
        stalled = str(exc)
    after = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    return {"stalled": stalled, "after": after.tolist()}


def test_an_op_no_other_rank_submits_fails_after_the_timeout_naming_who_lacks_it() -> None:
    outcomes = run_ranks(2, _stall_body)
    for rank, out in enumerate(outcomes):
        assert f"'only-on-rank-{rank}' stalled" in out["stalled"], out["stalled"]
        assert f"ranks [{1 - rank}] did not submit it" in out["stalled"], out["stalled"]
        assert out["after"] == [2.0, 2.0]


def test_mismatch_messages_name_each_rank() -> None:
    from libworker.signatures import Signature, TensorSignature, mismatch

    a = Signature("allreduce", (TensorSignature("float32", (17, 17)),), op=0)
    b = Signature("allreduce", (TensorSignature("float32", (18, 17)),), op=0)
    assert (
        mismatch({0: a, 1: b, 2: a})
        == "Mismatched allreduce tensor shapes: ranks 0, 2 have [17, 17], rank 1 has [18, 17]"
    )
    assert mismatch({0: a, 1: a}) is None


def _autograd_and_optimizer_body() -> dict[str, Any]:
    import libworker as hvd

    rank, size = hvd.rank(), hvd.size()
    out: dict[str, Any] = {}
    x = torch.full((3,), float(rank + 1), requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * torch.arange(3.0)).sum().backward()
    out["allreduce_grad"] = x.grad.tolist()
    y = torch.ones(rank + 1, 2, requires_grad=True)
    hvd.allgather(y).sum().backward()
    out["allgather_grad"] = y.grad.tolist()
    z = torch.ones(4, requires_grad=True)
    hvd.broadcast(z, root_rank=0).sum().backward()
    out["broadcast_grad"] = z.grad.tolist()

    handle = hvd.sparse_allreduce_async(torch.tensor([0.0, rank + 1.0, 0.0]).to_sparse(), op=hvd.Sum)
    out["sparse"] = handle().to_dense().tolist()

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(6, 2, sparse=True)
    sparse_opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(embedding.parameters()), lr=0.1))
    sparse_opt.zero_grad()
    embedding(torch.tensor([rank, 3])).sum().backward()
    sparse_opt.step()
    out["sparse_grad_is_sparse"] = embedding.weight.grad.is_sparse
    out["sparse_grad"] = embedding.weight.grad.to_dense().tolist()
    out["parameter_names"] = sorted(sparse_opt._parameter_names.values())

    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    torch.manual_seed(0)
    linear = torch.nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(linear.parameters(), lr=1.0), process_set=evens)
    opt.zero_grad()
    linear(torch.full((1, 2), float(rank + 1))).sum().backward()
    opt.step()
    out["set_step"] = linear.weight.detach().flatten().tolist()
    return out


def test_gradients_flow_through_collectives_and_the_optimizer_handles_sparse_grads_and_process_sets() -> None:
    size = 3
    outcomes = run_ranks(size, _autograd_and_optimizer_body)
    members = [0, 2]
    torch.manual_seed(0)
    initial = torch.nn.Linear(2, 1, bias=False).weight.detach().flatten().numpy()
    for rank, out in enumerate(outcomes):
        assert out["allreduce_grad"] == [0.0, float(size), 2.0 * size], (
            "the gradient of a sum is the sum of the gradients"
        )
        assert out["allgather_grad"] == [[1.0, 1.0]] * (rank + 1), "each rank gets its rows of the averaged gradient"
        assert out["broadcast_grad"] == ([1.0] * 4 if rank == 0 else [0.0] * 4)
        assert out["sparse"] == [0.0, float(sum(range(1, size + 1))), 0.0]
        assert out["sparse_grad_is_sparse"]
        expected = torch.zeros(6, 2)
        for r in range(size):
            expected[r] += 1.0 / size
            expected[3] += 1.0 / size
        np.testing.assert_allclose(np.array(out["sparse_grad"]), expected.numpy(), rtol=1e-6)
        assert out["parameter_names"] == ["allreduce.noname.0.0"]
        inputs = [float(r + 1) for r in (members if rank in members else [rank])]
        np.testing.assert_allclose(np.array(out["set_step"]), initial - np.mean(inputs), rtol=1e-6)


def _step_after_a_failed_step_body() -> dict[str, Any]:
    import torch.nn.functional as F

    import libworker as hvd
    from libworker.world import world

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )

    def step() -> None:
        optimizer.zero_grad()
        F.mse_loss(model(torch.full((3, 4), float(hvd.rank()))), torch.zeros(3, 2)).backward()
        optimizer.step()

    step()
    world.aborted_round = world.round  # the control plane aborts this round: the next step fails
    try:
        step()
        failed = "nothing raised"
    except hvd.HorovodInternalError as exc:
        failed = str(exc)
    world.aborted_round, world.poisoned = 0, False  # as after a re-join: a new round on a working group
    world.round += 1
    world.slot = {**world.slot, "round": world.round}
    step()
    step()
    return {"failed": failed, "params": [p.detach().numpy().copy() for p in model.parameters()]}


def test_a_step_after_a_failed_step_reduces_again() -> None:
    """A step that failed (an abort) leaves nothing behind: the next round's steps reduce and stay identical."""
    outcomes = run_ranks(2, _step_after_a_failed_step_body)
    for out in outcomes:
        assert "aborted by the control plane" in out["failed"]
    for mine, theirs in zip(outcomes[0]["params"], outcomes[1]["params"]):
        np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("op_name, users_compression", [("Max", False), ("Average", True)])
def test_a_step_whose_data_cannot_count_joins_agrees_on_every_step(op_name: str, users_compression: bool) -> None:
    """Under op=Max, or through a user's compressor, the first bucket's count of joined ranks is not a sum that
    arrives exact: every step sends its one small agreement ahead of its bucket."""
    for per_step in run_ranks(2, _collectives_per_step_body, op_name, users_compression):
        assert per_step[1:] == [2, 2, 2]
