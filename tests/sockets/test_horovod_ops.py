"""libworker's Horovod torch API on real gloo groups of 2, 3 and 4 ranks, checked against single-process references.

Each world size runs one body (`run_ranks`) that exercises many calls and returns their results; the tests then
compare them with references computed here, in the test process, by plain torch code (never libworker's). The
collectives run on 2 and 4 ranks, the optimizer checks on 2, the refusal of Adasum on 3:

- allreduce: ops Sum, Average (default), Min, Max, Product, the strings "sum"/"mean", the deprecated `average=`
  (DeprecationWarning; with `op=` a ValueError), pre/post-scale factors, `allreduce_` in place, the async form with
  poll/synchronize, grouped_allreduce over shapes and dtypes (float32 + float64), `name=`, integer tensors;
- Adasum: the pairwise tree combination ((0,1), (2,3), then the two results), orthogonal vectors summing, identical
  vectors staying, grouped Adasum per tensor, and the refusal of a non power-of-two size (3 ranks);
- compression: fp16 keeps the input's dtype within fp16 tolerance; a user compressor's static methods are used;
- broadcast (plain, in place, async) from root 1 and bad roots, allgather of different first dimensions, alltoall
  with and without splits, reducescatter with uneven rows, broadcast_object / allgather_object, barrier, join,
  and the refusal of process sets;
- DistributedOptimizer on an MLP (same init everywhere, data per rank) with SGD + momentum against training on the
  averaged (or summed) gradient: predivide factor, fp16, backward_passes_per_step=2, groups, fusion thresholds,
  synchronize + clipping + skip_synchronize, zero_grad misuse, a parameter unused on some ranks, and the Adasum
  optimizer (local steps, deltas combined per tensor);
- broadcast_optimizer_state (Adam states and hyper-parameters that differ, and a fresh optimizer, left with zero
  gradients as Horovod leaves it) and
  broadcast_parameters with a state_dict and with named_parameters.

Tensors come back from the ranks as numpy arrays: a torch tensor put on the results queue would travel through
shared memory, which the rank's process no longer serves once it has exited.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from testing.ranks import run_ranks

LR, MOMENTUM, STEPS, CLIP = 0.1, 0.9, 3, 0.05

# ---------------------------------------------------------------------------------------------------------------------
# Inputs: deterministic functions of (tag, rank, ...), the same in the ranks and in the test process.


def _randn(tag: str, *key: Any, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    seed = zlib.crc32("/".join([tag, *map(str, key)]).encode())
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


class _Net(torch.nn.Module):
    """An MLP whose buckets can be split several ways (weights of 2, 4 and 0.5 KiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class _Branchy(torch.nn.Module):
    """A model with a branch (`extra`) that only some ranks use; every parameter has the same size."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.extra = (torch.nn.Linear(8, 8, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        out = self.head(torch.tanh(self.body(x)))
        return out + self.extra(x) if use_extra else out


def _build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return _Net() if kind == "mlp" else _Branchy()


def _batch(kind: str, rank: int, step: int, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width_in, width_out = (16, 4) if kind == "mlp" else (8, 8)
    return _randn("x", kind, rank, step, part, shape=(6, width_in)), _randn(
        "y", kind, rank, step, part, shape=(6, width_out)
    )


def _loss(
    model: torch.nn.Module, kind: str, rank: int, step: int, part: int = 0, use_extra: bool = False
) -> torch.Tensor:
    x, y = _batch(kind, rank, step, part)
    return F.mse_loss(model(x, use_extra), y)


# ---------------------------------------------------------------------------------------------------------------------
# References (plain torch, in the test process).


def _adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.double(), b.double()
    dot = torch.dot(a, b)
    return (1 - dot / (2 * torch.dot(a, a))) * a + (1 - dot / (2 * torch.dot(b, b))) * b


def _adasum_tree(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Ranks (0,1), (2,3), ... first, then the results pairwise; per tensor (flattened), in float64."""
    shape = tensors[0].shape
    level = [t.reshape(-1) for t in tensors]
    while len(level) > 1:
        level = [_adasum_pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0].reshape(shape)


class _SGD:
    """torch.optim.SGD's update with momentum (no dampening, no Nesterov), written out: the reference needs no
    torch.optim (whose first use imports torch._dynamo, seconds of CPU on a loaded machine)."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params = list(params)
        self.buffers: list[torch.Tensor | None] = [None] * len(params)

    def step(self) -> None:
        with torch.no_grad():
            for index, p in enumerate(self.params):
                buf = self.buffers[index]
                buf = p.grad.clone() if buf is None else buf.mul_(MOMENTUM).add_(p.grad)
                self.buffers[index] = buf
                p.add_(buf, alpha=-LR)


def _reference_training(
    size: int,
    kind: str = "mlp",
    *,
    steps: int = STEPS,
    passes: int = 1,
    total: bool = False,
    clip: float | None = None,
    extra_on: int | None = None,
) -> list[torch.Tensor]:
    """One model trained on the average (or sum) over ranks of each rank's local gradient, computed here."""
    model = _build(kind)
    params = list(model.parameters())
    opt = _SGD(params)
    for step in range(steps):
        combined = [torch.zeros_like(p) for p in params]
        for rank in range(size):
            for p in params:
                p.grad = None
            for part in range(passes):
                _loss(model, kind, rank, step, part, use_extra=extra_on == rank).backward()
            for c, p in zip(combined, params):
                if p.grad is not None:
                    c += p.grad
        for p, c in zip(params, combined):
            p.grad = c if total else c / size
        if clip is not None:
            norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
            coefficient = min(1.0, clip / (float(norm) + 1e-6))
            for p in params:
                p.grad.mul_(coefficient)
        opt.step()
    return [p.detach().clone() for p in params]


def _reference_adasum_training(size: int, steps: int = STEPS) -> list[torch.Tensor]:
    """Every rank steps its own SGD (own momentum) from the shared start; the deltas combine with Adasum per tensor."""
    shared = list(_build("mlp").parameters())
    models = [_build("mlp") for _ in range(size)]
    opts = [_SGD(list(m.parameters())) for m in models]
    for step in range(steps):
        start = [p.detach().clone() for p in shared]
        deltas = []
        for rank, (model, opt) in enumerate(zip(models, opts)):
            with torch.no_grad():
                for p, s in zip(model.parameters(), start):
                    p.copy_(s)
            model.zero_grad()
            _loss(model, "mlp", rank, step).backward()
            opt.step()
            deltas.append([p.detach() - s for p, s in zip(model.parameters(), start)])
        with torch.no_grad():
            for index, (p, s) in enumerate(zip(shared, start)):
                p.copy_(s + _adasum_tree([d[index] for d in deltas]).float())
    return [p.detach().clone() for p in shared]


# ---------------------------------------------------------------------------------------------------------------------
# What the ranks run. Each section's result (or its traceback) comes back under its name.

_SECTIONS: list[tuple[str, Callable[..., Any]]] = []


def _section(func: Callable[..., Any]) -> Callable[..., Any]:
    _SECTIONS.append((func.__name__.lstrip("_"), func))
    return func


def _pack(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone().numpy()
    if isinstance(obj, dict):
        return {k: _pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pack(v) for v in obj)
    return obj


def _unpack(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v) for v in obj)
    return obj


def _raises(exc_type: type[BaseException], func: Callable[[], Any]) -> str:
    """The name of what `func()` raised, 'nothing', or (if it is not `exc_type`) the exception's repr."""
    try:
        func()
    except exc_type as exc:
        return f"{exc_type.__name__}: {exc}"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"wrong exception {exc!r}"
    return "nothing"


def _run_sections(names: list[str], size: int) -> dict[str, Any]:
    import libworker as hvd

    torch.set_num_threads(1)  # ranks share few cores: intra-op threads would only contend (tiny tensors here)
    rank = hvd.rank()
    assert hvd.size() == size
    out: dict[str, Any] = {}
    for name, func in _SECTIONS:
        if name in names:
            try:
                out[name] = ("ok", _pack(func(hvd, rank, size)))
            except Exception:  # noqa: BLE001 - the test reports it
                out[name] = ("error", traceback.format_exc())
    return out


COLLECTIVE_SECTIONS = ["allreduce", "adasum", "compression", "collectives", "parameters"]
OPTIMIZER_SECTIONS = ["optimizer", "optimizer_misc", "optimizer_state"]


def _body(size: int, sections: list[str]) -> dict[str, Any]:
    return _run_sections(sections, size)


def _body_three() -> dict[str, Any]:
    return _run_sections(["three_ranks"], 3)


@_section
def _allreduce(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    x = _randn("allreduce", rank, shape=(5, 3))
    r: dict[str, Any] = {"input": x.clone()}
    for name, op in [
        ("sum", hvd.Sum),
        ("average", hvd.Average),
        ("min", hvd.Min),
        ("max", hvd.Max),
        ("product", hvd.Product),
    ]:
        r[name] = hvd.allreduce(x, op=op)
    r["default"] = hvd.allreduce(x)
    r["str_sum"], r["str_mean"] = hvd.allreduce(x, op="sum"), hvd.allreduce(x, op="mean")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r["average_true"] = hvd.allreduce(x, average=True)
        r["average_false"] = hvd.allreduce(x, average=False)
    r["average_warnings"] = [w.category.__name__ for w in caught]
    r["average_and_op"] = _raises(ValueError, lambda: hvd.allreduce(x, average=True, op=hvd.Sum))
    r["scaled_sum"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    r["scaled_average"] = hvd.allreduce(x, prescale_factor=2.0, postscale_factor=0.25)
    r["named"] = hvd.allreduce(x, name="tests.named", op=hvd.Sum)
    r["input_after"] = x.clone()

    inplace = x.clone()
    returned = hvd.allreduce_(inplace, op=hvd.Sum)
    r["inplace_is_input"], r["inplace"] = returned is inplace, inplace.clone()

    handle = hvd.allreduce_async(x, op=hvd.Max, name="tests.async")
    deadline = time.monotonic() + 30
    polls = []
    while not polls or not polls[-1]:
        polls.append(hvd.poll(handle))
        assert time.monotonic() < deadline, "poll never became true"
        time.sleep(0.001)
    r["poll_types"] = sorted({type(p).__name__ for p in polls})
    r["async"] = hvd.synchronize(handle)
    async_inplace = x.clone()
    r["async_inplace_is_input"] = hvd.synchronize(hvd.allreduce_async_(async_inplace, op=hvd.Sum)) is async_inplace
    r["async_inplace"] = async_inplace

    grouped = [
        _randn("grouped", rank, 0, shape=(4,)),
        _randn("grouped", rank, 1, shape=(2, 3), dtype=torch.float64),
        _randn("grouped", rank, 2, shape=(3, 2, 2)),
    ]
    r["grouped_input"] = [g.clone() for g in grouped]
    r["grouped_sum"] = hvd.grouped_allreduce(grouped, op=hvd.Sum, name="tests.grouped")
    r["grouped_average"] = hvd.grouped_allreduce(grouped)
    r["grouped_input_after"] = [g.clone() for g in grouped]
    grouped_inplace = [g.clone() for g in grouped]
    hvd.grouped_allreduce_(grouped_inplace, op=hvd.Sum)
    r["grouped_inplace"] = grouped_inplace
    r["grouped_dtypes"] = [str(t.dtype) for t in r["grouped_sum"]]

    ints64 = torch.arange(6, dtype=torch.int64).reshape(2, 3) * (rank + 1) + rank
    r["int64_sum"], r["int64_max"] = hvd.allreduce(ints64, op=hvd.Sum), hvd.allreduce(ints64, op=hvd.Max)
    r["int32_sum"] = hvd.allreduce(ints64.to(torch.int32), op=hvd.Sum)
    r["int_dtypes"] = [str(r["int64_sum"].dtype), str(r["int32_sum"].dtype)]
    r["scalar_sum"] = hvd.allreduce(torch.tensor(float(rank + 1)), op=hvd.Sum)
    return r


@_section
def _adasum(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    v64 = _randn("adasum", rank, shape=(10,), dtype=torch.float64)
    r["float64"] = hvd.allreduce(v64, op=hvd.Adasum)
    r["float32"] = hvd.allreduce(v64.float(), op=hvd.Adasum)
    r["matrix"] = hvd.allreduce(_randn("adasum-matrix", rank, shape=(3, 4), dtype=torch.float64), op=hvd.Adasum)
    r["string_op"] = hvd.allreduce(v64, op="adasum")
    orthogonal = torch.zeros(2 * size, dtype=torch.float64)
    orthogonal[2 * rank] = rank + 1.0
    orthogonal[2 * rank + 1] = -0.5 * rank
    r["orthogonal"] = hvd.allreduce(orthogonal, op=hvd.Adasum)
    same = _randn("adasum-same", shape=(7,), dtype=torch.float64)
    r["same"] = hvd.allreduce(same, op=hvd.Adasum)
    r["grouped"] = hvd.grouped_allreduce(
        [
            _randn("adasum-g", rank, 0, shape=(6,), dtype=torch.float64),
            _randn("adasum-g", rank, 1, shape=(2, 3), dtype=torch.float64) * (rank + 1),
        ],
        op=hvd.Adasum,
    )
    return r


class _ScaleCompressor:
    """A user compressor: sends 4x the tensor and only halves it back, so its use shows in the result (2x)."""

    calls: dict[str, int] = {"compress": 0, "decompress": 0}
    contexts: list[Any] = []

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        _ScaleCompressor.calls["compress"] += 1
        return tensor * 4.0, ("ctx", str(tensor.dtype))

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        _ScaleCompressor.calls["decompress"] += 1
        _ScaleCompressor.contexts.append(ctx)
        return tensor / 2.0


@_section
def _compression(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    x = _randn("fp16", rank, shape=(64,))
    x64 = _randn("fp16", rank, 64, shape=(3, 5), dtype=torch.float64)
    r: dict[str, Any] = {
        "fp16_sum": hvd.allreduce(x, compression=hvd.Compression.fp16, op=hvd.Sum),
        "fp16_average": hvd.allreduce(x, compression=hvd.Compression.fp16),
        "fp16_float64": hvd.allreduce(x64, compression=hvd.Compression.fp16, op=hvd.Sum),
        "fp16_grouped": hvd.grouped_allreduce([x, x64], compression=hvd.Compression.fp16, op=hvd.Sum),
        "none": hvd.allreduce(x, compression=hvd.Compression.none, op=hvd.Sum),
    }
    r["fp16_dtypes"] = [str(r[k].dtype) for k in ("fp16_sum", "fp16_average", "fp16_float64")] + [
        str(t.dtype) for t in r["fp16_grouped"]
    ]
    _ScaleCompressor.calls.update(compress=0, decompress=0)
    _ScaleCompressor.contexts.clear()
    r["user"] = hvd.allreduce(x, compression=_ScaleCompressor, op=hvd.Sum)
    r["user_calls"] = dict(_ScaleCompressor.calls)
    r["user_contexts"] = list(_ScaleCompressor.contexts)
    return r


@_section
def _collectives(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    x = _randn("broadcast", rank, shape=(4, 2))
    r: dict[str, Any] = {"broadcast": hvd.broadcast(x, root_rank=1), "broadcast_input_after": x.clone()}
    inplace = x.clone()
    r["broadcast_inplace_is_input"] = hvd.broadcast_(inplace, root_rank=1) is inplace
    r["broadcast_inplace"] = inplace
    async_inplace = x.clone()
    r["broadcast_async_is_input"] = hvd.synchronize(hvd.broadcast_async_(async_inplace, root_rank=1)) is async_inplace
    r["broadcast_async_inplace"] = async_inplace
    r["broadcast_async"] = hvd.synchronize(hvd.broadcast_async(x, root_rank=1))
    r["bad_roots"] = [
        _raises(ValueError, lambda: hvd.broadcast(x, root_rank=size)),
        _raises(ValueError, lambda: hvd.broadcast_(x.clone(), root_rank=-1)),
        _raises(ValueError, lambda: hvd.broadcast_object("x", root_rank=size)),
    ]

    r["allgather"] = hvd.allgather(_randn("allgather", rank, shape=(rank + 1, 3)))
    r["grouped_allgather"] = hvd.grouped_allgather(
        [_randn("allgather", rank, shape=(rank + 1, 3)), torch.full((2 - rank % 2,), rank, dtype=torch.int64)]
    )

    rows = 2 * size
    table = torch.stack([torch.full((2,), 100.0 * rank + row) for row in range(rows)])
    r["alltoall"] = hvd.alltoall(table)
    r["alltoall_returns_tensor"] = isinstance(r["alltoall"], torch.Tensor)
    splits = [(rank + 2 * j) % 3 for j in range(size)]
    uneven = (
        torch.stack([torch.tensor([100.0 * rank + row, rank]) for row in range(sum(splits))])
        if sum(splits)
        else torch.zeros(0, 2)
    )
    result = hvd.alltoall(uneven, splits=torch.tensor(splits, dtype=torch.int32))
    r["alltoall_splits_is_pair"] = isinstance(result, tuple) and len(result) == 2
    r["alltoall_splits"], r["alltoall_received_splits"] = result[0], result[1]

    scatter = _randn("reducescatter", rank, shape=(2 * size + 1, 3))
    r["reducescatter"] = hvd.reducescatter(scatter)
    r["reducescatter_sum"] = hvd.reducescatter(scatter, op=hvd.Sum)

    r["broadcast_object"] = hvd.broadcast_object({"from": rank, "items": [rank] * 3}, root_rank=1)
    r["allgather_object"] = hvd.allgather_object(("rank", rank, {"square": rank * rank}))
    r["barrier"] = hvd.barrier()
    r["join"] = hvd.join()
    r["after_join"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)

    r["process_set_global"] = hvd.allreduce(x, op=hvd.Sum, process_set=hvd.global_process_set)
    r["process_set"] = [
        _raises(ValueError, lambda: hvd.allreduce(x, process_set=hvd.ProcessSet([0]))),
        _raises(ValueError, lambda: hvd.broadcast(x, 0, process_set=hvd.ProcessSet([0]))),
    ]
    evens = hvd.add_process_set([k for k in range(hvd.size()) if k % 2 == 0])
    r["evens"] = hvd.allreduce(x, op=hvd.Sum, process_set=evens).numpy() if evens.included() else None
    r["evens_rank"], r["evens_size"] = evens.rank(), evens.size()
    r["duplicate_set"] = _raises(ValueError, lambda: hvd.add_process_set([k for k in range(hvd.size()) if k % 2 == 0]))
    r["removed"] = hvd.remove_process_set(evens)
    return r


def _train(
    hvd: Any,
    rank: int,
    kind: str = "mlp",
    *,
    steps: int = STEPS,
    passes: int = 1,
    clip: float | None = None,
    extra_on: int | None = None,
    threshold: str | None = None,
    groups: str | None = None,
    **wrap: Any,
) -> dict[str, Any]:
    """Train with a DistributedOptimizer as a user would; the final parameters and the number of buckets."""
    model = _build(kind)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    if groups == "two":
        wrap["groups"] = 2
    elif groups == "lists":
        wrap["groups"] = [[model.l1.weight, model.l1.bias], [model.l3.weight, model.l3.bias, model.l2.weight]]
    saved = os.environ.get("ELASTIC_FUSION_THRESHOLD")
    if threshold is not None:
        os.environ["ELASTIC_FUSION_THRESHOLD"] = threshold
    try:
        opt = hvd.DistributedOptimizer(
            opt, named_parameters=model.named_parameters(), backward_passes_per_step=passes, **wrap
        )
    finally:
        if saved is None:
            os.environ.pop("ELASTIC_FUSION_THRESHOLD", None)
        else:
            os.environ["ELASTIC_FUSION_THRESHOLD"] = saved
    norms = []
    for step in range(steps):
        opt.zero_grad()
        for part in range(passes):
            _loss(model, kind, rank, step, part, use_extra=extra_on == rank).backward()
        if clip is None:
            opt.step()
        else:
            opt.synchronize()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with opt.skip_synchronize():
                    opt.step()
    buckets = getattr(getattr(opt, "_reducer", None), "buckets", None)
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "buckets": None if buckets is None else len(buckets),
        "norms": norms,
    }


OPTIMIZER_VARIANTS: dict[str, dict[str, Any]] = {
    "average": {},
    "sum": {"op": "Sum"},
    "predivide": {"gradient_predivide_factor": 2.0},
    "fp16": {"compression": "fp16"},
    "passes": {"passes": 2},
    "groups_two": {"groups": "two"},
    "groups_lists": {"groups": "lists"},
    "fusion_zero": {"threshold": "0"},
    "fusion_small": {"threshold": "4096"},
    "clip": {"clip": CLIP},
    "adasum": {"op": "Adasum"},
}


@_section
def _optimizer(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    out = {}
    for name, options in OPTIMIZER_VARIANTS.items():
        options = dict(options)
        if "op" in options:
            options["op"] = getattr(hvd, options["op"])
        if "compression" in options:
            options["compression"] = getattr(hvd.Compression, options["compression"])
        out[name] = _train(hvd, rank, **options)
    return out


@_section
def _optimizer_misc(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    r: dict[str, Any] = {"unused": _train(hvd, rank, "branchy", extra_on=0)}
    # The same with one parameter per bucket: the unused branch's bucket is ready (and sent) during backward on rank 0
    # but only at synchronize() on the others. Every parameter has the same size, so buckets going out in a different
    # order on different ranks would show as wrong numbers rather than as a gloo abort.
    r["unused_per_parameter"] = _train(hvd, rank, "branchy", extra_on=0, threshold="0")
    model = _build("mlp")
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM), named_parameters=model.named_parameters()
    )
    r["isinstance_sgd"] = isinstance(opt, torch.optim.SGD)
    r["isinstance_adam"] = isinstance(
        hvd.DistributedOptimizer(torch.optim.Adam(_build("mlp").parameters())), torch.optim.Adam
    )
    _loss(model, "mlp", rank, 0).backward()
    r["zero_grad_before_step"] = _raises(AssertionError, opt.zero_grad)
    opt.step()  # finishes the reduction the backward started, on every rank alike
    r["after_misuse"] = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    _loss(model, "mlp", rank, 1).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # after synchronize(), outside skip_synchronize(): Horovod warns
    r["step_after_synchronize_warnings"] = [w.category.__name__ for w in caught]
    adasum = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), op=hvd.Adasum)

    def skip_with_adasum() -> None:
        with adasum.skip_synchronize():
            pass

    r["adasum_skip_synchronize"] = _raises(AssertionError, skip_with_adasum)
    return r


def _optimizer_state_of(opt: torch.optim.Optimizer) -> dict[str, Any]:
    state = opt.state_dict()
    return {
        "state": {
            pid: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in entry.items()}
            for pid, entry in state["state"].items()
        },
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]],
    }


@_section
def _optimizer_state(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    model = _build("mlp")
    opt = torch.optim.Adam(
        model.parameters(), lr=0.01 * (rank + 1), betas=(0.9, 0.99 - 0.01 * rank), weight_decay=0.001 * rank
    )
    for step in range(rank + 1):  # states differ: different data, lr and number of steps
        opt.zero_grad()
        _loss(model, "mlp", rank, step).backward()
        opt.step()
    r["before"] = _optimizer_state_of(opt)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    r["after"] = _optimizer_state_of(opt)
    r["lr_attribute"] = opt.param_groups[0]["lr"]
    # Still a working Adam: with parameters broadcast too and the same data everywhere, the ranks stay equal.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt.zero_grad()
    _loss(model, "mlp", 0, 99).backward()
    opt.step()
    r["params_after_next_step"] = [p.detach().clone() for p in model.parameters()]

    torch.manual_seed(100 + rank)  # a fresh optimizer on parameters that differ per rank
    fresh_model = _Net()
    fresh_params = [p.detach().clone() for p in fresh_model.parameters()]
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=0.001 * (rank + 1))
    hvd.broadcast_optimizer_state(fresh, root_rank=0)
    r["fresh"] = _optimizer_state_of(fresh)
    r["fresh_params_unchanged"] = all(torch.equal(a, b) for a, b in zip(fresh_params, fresh_model.parameters()))
    r["fresh_grads_zero"] = all(p.grad is not None and not p.grad.any() for p in fresh_model.parameters())
    wrapped = hvd.DistributedOptimizer(
        torch.optim.SGD(fresh_model.parameters(), lr=0.1 * (rank + 1), momentum=0.5 + 0.1 * rank),
        named_parameters=fresh_model.named_parameters(),
    )
    hvd.broadcast_optimizer_state(wrapped, root_rank=0)
    r["fresh_wrapped"] = _optimizer_state_of(wrapped)
    return r


@_section
def _parameters(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    torch.manual_seed(200 + rank)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    net(_randn("bn", rank, shape=(5, 4)))  # running statistics differ per rank too
    r: dict[str, Any] = {"state_before": {k: v.clone() for k, v in net.state_dict().items()}}
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    r["state_after"] = {k: v.clone() for k, v in net.state_dict().items()}
    for p in net.parameters():
        p.data.add_(rank)
    r["named_before"] = {k: v.detach().clone() for k, v in net.named_parameters()}
    hvd.broadcast_parameters(net.named_parameters(), root_rank=1)
    r["named_after"] = {k: v.detach().clone() for k, v in net.named_parameters()}
    return r


@_section
def _three_ranks(hvd: Any, rank: int, size: int) -> dict[str, Any]:
    x = _randn("three", rank, shape=(6,))
    r: dict[str, Any] = {
        "allreduce": _raises(ValueError, lambda: hvd.allreduce(x, op=hvd.Adasum)),
        "grouped": _raises(ValueError, lambda: hvd.grouped_allreduce([x, x * 2], op=hvd.Adasum)),
        "sum_after": hvd.allreduce(x, op=hvd.Sum),
    }
    return r


# ---------------------------------------------------------------------------------------------------------------------
# The tests.


@functools.cache
def _outcomes(size: int) -> list[dict[str, Any]]:
    """One run per size: 2 ranks run every section, 4 ranks the collectives (torch.optim's first use costs each rank
    process seconds of CPU importing torch._dynamo, so the optimizer sections run on 2 ranks only)."""
    sections = COLLECTIVE_SECTIONS + (OPTIMIZER_SECTIONS if size == 2 else [])
    return run_ranks(size, _body, size, sections, timeout=120)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda size: f"{size}ranks")
def world(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    return request.param, _outcomes(request.param)


@pytest.fixture(scope="module")
def pair() -> tuple[int, list[dict[str, Any]]]:
    return 2, _outcomes(2)


@pytest.fixture(scope="module")
def three() -> list[dict[str, Any]]:
    return run_ranks(3, _body_three, timeout=120)


def _results(outcomes: list[dict[str, Any]], section: str) -> list[Any]:
    """One section's results, rank by rank (tensors back as torch tensors); fails with the rank's traceback."""
    errors = [
        f"rank {rank}:\n{value}"
        for rank, out in enumerate(outcomes)
        for status, value in [out[section]]
        if status != "ok"
    ]
    assert not errors, "\n".join(errors)
    return [_unpack(out[section][1]) for out in outcomes]


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def _all_close(results: list[torch.Tensor], expected: torch.Tensor, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    for rank, actual in enumerate(results):
        try:
            _close(actual, expected, rtol, atol)
        except AssertionError as exc:
            raise AssertionError(f"rank {rank}: {exc}") from None


def _params_close(
    results: list[list[torch.Tensor]], expected: list[torch.Tensor], rtol: float = 1e-5, atol: float = 1e-6
) -> None:
    for rank, params in enumerate(results):
        assert len(params) == len(expected)
        for index, (actual, want) in enumerate(zip(params, expected)):
            try:
                _close(actual, want, rtol, atol)
            except AssertionError as exc:
                raise AssertionError(f"rank {rank}, parameter {index}: {exc}") from None


def test_allreduce_ops(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "allreduce")
    xs = torch.stack([_randn("allreduce", rank, shape=(5, 3)) for rank in range(size)])
    expected = {
        "sum": xs.sum(0),
        "average": xs.mean(0),
        "min": xs.min(0).values,
        "max": xs.max(0).values,
        "product": xs.prod(0),
        "default": xs.mean(0),
        "str_sum": xs.sum(0),
        "str_mean": xs.mean(0),
        "named": xs.sum(0),
    }
    for name, want in expected.items():
        _all_close([r[name] for r in res], want)
    for rank, r in enumerate(res):
        assert torch.equal(r["input_after"], xs[rank]), "allreduce changed its input"
    _all_close(
        [r["int64_sum"] for r in res],
        sum(torch.arange(6, dtype=torch.int64).reshape(2, 3) * (k + 1) + k for k in range(size)),
    )
    _all_close(
        [r["int32_sum"] for r in res],
        sum(torch.arange(6, dtype=torch.int32).reshape(2, 3) * (k + 1) + k for k in range(size)),
    )
    _all_close([r["int64_max"] for r in res], torch.arange(6, dtype=torch.int64).reshape(2, 3) * size + size - 1)
    _all_close([r["scalar_sum"] for r in res], torch.tensor(size * (size + 1) / 2))


def test_allreduce_deprecated_average_and_op_names(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "allreduce")
    xs = torch.stack([_randn("allreduce", rank, shape=(5, 3)) for rank in range(size)])
    _all_close([r["average_true"] for r in res], xs.mean(0))
    _all_close([r["average_false"] for r in res], xs.sum(0))
    for r in res:
        assert r["average_warnings"] == ["DeprecationWarning", "DeprecationWarning"]
        assert r["average_and_op"].startswith("ValueError"), r["average_and_op"]


def test_allreduce_scaling_in_place_and_async(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "allreduce")
    xs = torch.stack([_randn("allreduce", rank, shape=(5, 3)) for rank in range(size)])
    _all_close([r["scaled_sum"] for r in res], (xs * 0.5).sum(0) * 3.0)
    _all_close([r["scaled_average"] for r in res], (xs * 2.0).mean(0) * 0.25)
    _all_close([r["inplace"] for r in res], xs.sum(0))
    _all_close([r["async"] for r in res], xs.max(0).values)
    _all_close([r["async_inplace"] for r in res], xs.sum(0))
    for r in res:
        assert r["inplace_is_input"] and r["async_inplace_is_input"]
        assert r["poll_types"] == ["bool"]


def test_grouped_allreduce_mixed_shapes_and_dtypes(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "allreduce")
    inputs = [
        [
            _randn("grouped", rank, 0, shape=(4,)),
            _randn("grouped", rank, 1, shape=(2, 3), dtype=torch.float64),
            _randn("grouped", rank, 2, shape=(3, 2, 2)),
        ]
        for rank in range(size)
    ]
    for index in range(3):
        stacked = torch.stack([inputs[rank][index] for rank in range(size)])
        _all_close([r["grouped_sum"][index] for r in res], stacked.sum(0))
        _all_close([r["grouped_inplace"][index] for r in res], stacked.sum(0))
        _all_close([r["grouped_average"][index] for r in res], stacked.mean(0))
    for rank, r in enumerate(res):
        assert r["grouped_dtypes"] == ["torch.float32", "torch.float64", "torch.float32"]
        for before, after, original in zip(r["grouped_input"], r["grouped_input_after"], inputs[rank]):
            assert torch.equal(before, original) and torch.equal(after, original), (
                "grouped_allreduce changed its inputs"
            )


def test_adasum_allreduce(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "adasum")
    vs = [_randn("adasum", rank, shape=(10,), dtype=torch.float64) for rank in range(size)]
    _all_close([r["float64"] for r in res], _adasum_tree(vs), rtol=1e-12, atol=1e-12)
    _all_close([r["string_op"] for r in res], _adasum_tree(vs), rtol=1e-12, atol=1e-12)
    _all_close([r["float32"] for r in res], _adasum_tree([v.float() for v in vs]).float())
    matrices = [_randn("adasum-matrix", rank, shape=(3, 4), dtype=torch.float64) for rank in range(size)]
    _all_close([r["matrix"] for r in res], _adasum_tree(matrices), rtol=1e-12, atol=1e-12)
    # It is not just the average or the sum: the test data makes the coefficients matter.
    assert not torch.allclose(_adasum_tree(vs), torch.stack(vs).mean(0)) and not torch.allclose(
        _adasum_tree(vs), torch.stack(vs).sum(0)
    )
    orthogonal = []
    for rank in range(size):
        v = torch.zeros(2 * size, dtype=torch.float64)
        v[2 * rank], v[2 * rank + 1] = rank + 1.0, -0.5 * rank
        orthogonal.append(v)
    _all_close([r["orthogonal"] for r in res], torch.stack(orthogonal).sum(0), rtol=1e-12, atol=1e-12)
    _all_close([r["same"] for r in res], _randn("adasum-same", shape=(7,), dtype=torch.float64), rtol=1e-12, atol=1e-12)
    for r in res[1:]:
        assert torch.equal(r["float64"], res[0]["float64"]) and torch.equal(r["float32"], res[0]["float32"]), (
            "ranks differ"
        )


def test_adasum_grouped_allreduce_is_per_tensor(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "adasum")
    inputs = [
        [
            _randn("adasum-g", rank, 0, shape=(6,), dtype=torch.float64),
            _randn("adasum-g", rank, 1, shape=(2, 3), dtype=torch.float64) * (rank + 1),
        ]
        for rank in range(size)
    ]
    per_tensor = [_adasum_tree([inputs[rank][index] for rank in range(size)]) for index in range(2)]
    fused = _adasum_tree([torch.cat([t.reshape(-1) for t in inputs[rank]]) for rank in range(size)])
    assert not torch.allclose(torch.cat([t.reshape(-1) for t in per_tensor]), fused), (
        "test data cannot tell per-tensor from fused"
    )
    for index in range(2):
        _all_close([r["grouped"][index] for r in res], per_tensor[index], rtol=1e-12, atol=1e-12)


def test_fp16_and_user_compression(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "compression")
    xs = torch.stack([_randn("fp16", rank, shape=(64,)) for rank in range(size)])
    x64s = torch.stack([_randn("fp16", rank, 64, shape=(3, 5), dtype=torch.float64) for rank in range(size)])
    tolerance = {"rtol": 1e-2, "atol": 1e-2 * size}
    _all_close([r["fp16_sum"] for r in res], xs.sum(0), **tolerance)
    _all_close([r["fp16_average"] for r in res], xs.mean(0), **tolerance)
    _all_close([r["fp16_float64"] for r in res], x64s.sum(0), **tolerance)
    _all_close([r["fp16_grouped"][0] for r in res], xs.sum(0), **tolerance)
    _all_close([r["fp16_grouped"][1] for r in res], x64s.sum(0), **tolerance)
    _all_close([r["none"] for r in res], xs.sum(0))
    # fp16 really travelled: the result is what float16 sums give, not the float32 sum.
    assert not torch.equal(res[0]["fp16_sum"], res[0]["none"])
    for r in res:
        assert r["fp16_dtypes"] == ["torch.float32", "torch.float32", "torch.float64", "torch.float32", "torch.float64"]
    _all_close([r["user"] for r in res], xs.sum(0) * 2.0)
    for r in res:
        assert r["user_calls"] == {"compress": 1, "decompress": 1}
        assert r["user_contexts"] == [("ctx", "torch.float32")]


def test_broadcast(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "collectives")
    root = _randn("broadcast", 1, shape=(4, 2))
    for name in ("broadcast", "broadcast_inplace", "broadcast_async_inplace", "broadcast_async"):
        _all_close([r[name] for r in res], root)
    for rank, r in enumerate(res):
        assert torch.equal(r["broadcast_input_after"], _randn("broadcast", rank, shape=(4, 2))), (
            "broadcast changed its input"
        )
        assert r["broadcast_inplace_is_input"] and r["broadcast_async_is_input"]
        assert all(outcome.startswith("ValueError") for outcome in r["bad_roots"]), r["bad_roots"]


def test_allgather_alltoall_reducescatter(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "collectives")
    gathered = torch.cat([_randn("allgather", rank, shape=(rank + 1, 3)) for rank in range(size)])
    _all_close([r["allgather"] for r in res], gathered)
    _all_close([r["grouped_allgather"][0] for r in res], gathered)
    _all_close(
        [r["grouped_allgather"][1] for r in res],
        torch.cat([torch.full((2 - k % 2,), k, dtype=torch.int64) for k in range(size)]),
    )

    splits = [[(src + 2 * j) % 3 for j in range(size)] for src in range(size)]
    scattered = torch.stack([_randn("reducescatter", rank, shape=(2 * size + 1, 3)) for rank in range(size)])
    for me, r in enumerate(res):
        want = torch.stack([torch.full((2,), 100.0 * src + row) for src in range(size) for row in (2 * me, 2 * me + 1)])
        assert r["alltoall_returns_tensor"]
        _close(r["alltoall"], want)
        assert r["alltoall_splits_is_pair"]
        rows = []
        for src in range(size):
            start = sum(splits[src][:me])
            rows += [torch.tensor([100.0 * src + row, src]) for row in range(start, start + splits[src][me])]
        _close(r["alltoall_splits"], torch.stack(rows) if rows else torch.zeros(0, 2))
        assert r["alltoall_received_splits"].tolist() == [splits[src][me] for src in range(size)]
        base, extra = divmod(2 * size + 1, size)  # the first ranks get one more row
        start = me * base + min(me, extra)
        part = slice(start, start + base + (1 if me < extra else 0))
        _close(r["reducescatter"], scattered.mean(0)[part])
        _close(r["reducescatter_sum"], scattered.sum(0)[part])


def test_objects_barrier_join_and_process_sets(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "collectives")
    xs = torch.stack([_randn("broadcast", rank, shape=(4, 2)) for rank in range(size)])
    for r in res:
        assert r["broadcast_object"] == {"from": 1, "items": [1, 1, 1]}
        assert r["allgather_object"] == [("rank", k, {"square": k * k}) for k in range(size)]
        assert r["barrier"] is None
        assert isinstance(r["join"], int) and 0 <= r["join"] < size
        assert r["join"] == res[0]["join"], "join returned different ranks"
        assert r["after_join"].tolist() == [float(size)]
        _close(r["process_set_global"], xs.sum(0))
        assert all(outcome.startswith("ValueError") for outcome in r["process_set"]), r["process_set"]
        assert r["duplicate_set"].startswith("ValueError") and r["removed"] is True
        assert r["evens_size"] == len(range(0, size, 2))
    for rank, r in enumerate(res):
        if rank % 2:
            assert r["evens"] is None and r["evens_rank"] is None
        else:
            assert r["evens_rank"] == rank // 2
            _close(r["evens"], xs[0::2].sum(0))


def test_distributed_optimizer_matches_averaged_gradient_training(pair: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = pair
    res = _results(outcomes, "optimizer")
    average = _reference_training(size)
    for name in ("average", "predivide", "groups_two", "groups_lists", "fusion_zero", "fusion_small"):
        _params_close([r[name]["params"] for r in res], average)
    _params_close([r["sum"]["params"] for r in res], _reference_training(size, total=True))
    _params_close([r["fp16"]["params"] for r in res], average, rtol=1e-2, atol=2e-3)
    _params_close([r["passes"]["params"] for r in res], _reference_training(size, passes=2))
    initial = list(_build("mlp").parameters())
    assert not any(torch.allclose(p, q) for p, q in zip(average, initial)), "the reference did not train"
    buckets = {name: res[0][name]["buckets"] for name in ("average", "fusion_zero", "fusion_small")}
    if None not in buckets.values():  # the thresholds really split the model differently
        assert (
            buckets["average"] == 1
            and buckets["fusion_zero"] == len(initial)
            and 1 < buckets["fusion_small"] < len(initial)
        ), buckets


def test_distributed_optimizer_synchronize_clip_skip_synchronize(pair: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = pair
    res = _results(outcomes, "optimizer")
    _params_close([r["clip"]["params"] for r in res], _reference_training(size, clip=CLIP))
    assert all(norm > CLIP for norm in res[0]["clip"]["norms"]), "clipping never clipped"


def test_distributed_optimizer_contract(pair: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = pair
    res = _results(outcomes, "optimizer_misc")
    after_one_step = _reference_training(size, steps=1)
    for r in res:
        assert r["isinstance_sgd"] and r["isinstance_adam"]
        assert r["zero_grad_before_step"].startswith("AssertionError"), r["zero_grad_before_step"]
        assert r["step_after_synchronize_warnings"] == ["UserWarning"]
        assert r["adasum_skip_synchronize"].startswith("AssertionError"), r["adasum_skip_synchronize"]
    _params_close([r["after_misuse"] for r in res], after_one_step)


def test_distributed_optimizer_unused_parameter_on_some_ranks(pair: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = pair
    res = _results(outcomes, "optimizer_misc")
    _params_close([r["unused"]["params"] for r in res], _reference_training(size, "branchy", extra_on=0))


def test_distributed_optimizer_unused_parameter_one_bucket_per_parameter(
    pair: tuple[int, list[dict[str, Any]]],
) -> None:
    size, outcomes = pair
    res = _results(outcomes, "optimizer_misc")
    assert res[0]["unused_per_parameter"]["buckets"] in (None, 3)
    _params_close([r["unused_per_parameter"]["params"] for r in res], _reference_training(size, "branchy", extra_on=0))


def test_adasum_distributed_optimizer(pair: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = pair
    res = _results(outcomes, "optimizer")
    expected = _reference_adasum_training(size)
    _params_close([r["adasum"]["params"] for r in res], expected)
    assert not all(torch.allclose(p, q, atol=1e-4) for p, q in zip(expected, _reference_training(size))), (
        "Adasum and averaging agree on this data: the test cannot tell them apart"
    )


def _assert_same_state(actual: dict[str, Any], expected: dict[str, Any], label: str) -> None:
    assert actual["groups"] == expected["groups"], (
        f"{label}: hyper-parameters differ: {actual['groups']} vs {expected['groups']}"
    )
    assert sorted(actual["state"]) == sorted(expected["state"]), f"{label}: parameters with state differ"
    for pid, entry in expected["state"].items():
        assert sorted(actual["state"][pid]) == sorted(entry), f"{label}: state keys of parameter {pid} differ"
        for key, value in entry.items():
            got = actual["state"][pid][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), (
                    f"{label}: state {key} of parameter {pid} differs"
                )
            else:
                assert got == value, f"{label}: state {key} of parameter {pid} differs"


def test_broadcast_optimizer_state(pair: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = pair
    res = _results(outcomes, "optimizer_state")
    root = res[0]["before"]
    assert res[1]["before"]["groups"][0]["lr"] != root["groups"][0]["lr"]
    assert not torch.equal(res[1]["before"]["state"][0]["exp_avg"], root["state"][0]["exp_avg"]), (
        "states did not differ before"
    )
    assert res[1]["before"]["state"][0]["step"].item() == 2 and root["state"][0]["step"].item() == 1
    for rank, r in enumerate(res):
        _assert_same_state(r["after"], root, f"rank {rank} after broadcast_optimizer_state")
        assert r["lr_attribute"] == root["groups"][0]["lr"]
        for p, q in zip(r["params_after_next_step"], res[0]["params_after_next_step"]):
            assert torch.equal(p, q), f"rank {rank}: the next Adam step differs from rank 0's"
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert key in root["state"][0]
    for rank, r in enumerate(res):
        assert r["fresh"]["state"], f"rank {rank}: the fresh optimizer got no state"
        _assert_same_state(r["fresh"], res[0]["fresh"], f"rank {rank}, fresh Adam")
        assert r["fresh"]["groups"][0]["lr"] == 0.001
        assert r["fresh_params_unchanged"] and r["fresh_grads_zero"]
        assert r["fresh_wrapped"]["state"], f"rank {rank}: the fresh wrapped optimizer got no state"
        _assert_same_state(r["fresh_wrapped"], res[0]["fresh_wrapped"], f"rank {rank}, fresh wrapped SGD")
        assert r["fresh_wrapped"]["groups"][0]["momentum"] == 0.5


def test_broadcast_parameters(world: tuple[int, list[dict[str, Any]]]) -> None:
    size, outcomes = world
    res = _results(outcomes, "parameters")
    assert not torch.equal(res[0]["state_before"]["1.running_mean"], res[1]["state_before"]["1.running_mean"])
    for rank, r in enumerate(res):
        assert sorted(r["state_after"]) == sorted(res[0]["state_before"])
        for key, value in res[0]["state_before"].items():
            assert torch.equal(r["state_after"][key], value), f"rank {rank}: {key} is not rank 0's"
        for key, value in res[1]["named_before"].items():
            assert torch.equal(r["named_after"][key], value), f"rank {rank}: {key} is not rank 1's"


def test_adasum_refuses_a_size_that_is_not_a_power_of_two(three: list[dict[str, Any]]) -> None:
    res = _results(three, "three_ranks")
    xs = torch.stack([_randn("three", rank, shape=(6,)) for rank in range(3)])
    for r in res:
        for key in ("allreduce", "grouped"):
            assert r[key].startswith("ValueError") and "power" in r[key].lower() and "two" in r[key].lower(), r[key]
        _close(r["sum_after"], xs.sum(0))
