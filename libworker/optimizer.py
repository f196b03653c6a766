"""`DistributedOptimizer`: Horovod's optimizer contract, with DDP's mechanics for reducing gradients.

`hvd.DistributedOptimizer(opt, named_parameters=..., compression=..., op=...,
backward_passes_per_step=..., gradient_predivide_factor=..., groups=...)`
returns the same optimizer as an instance of a subclass of its own class
(`isinstance(opt, torch.optim.SGD)` still holds; its state and param_groups
are the original's). Before `step()` it reduces the gradients across the
round:

- Buckets are laid out once, in reverse parameter order (the order backward
  produces gradients): the first is small (1 MiB) so communication starts
  early, the others fill up to the fusion threshold (`ELASTIC_FUSION_THRESHOLD`
  or `HOROVOD_FUSION_THRESHOLD` bytes, default 25 MiB; 0 reduces each
  gradient alone), or follow `groups=` when given. Each bucket owns one flat
  buffer.
- A hook on each parameter's gradient accumulation counts backward passes
  (`backward_passes_per_step`); when every gradient of a bucket is ready, they
  are copied into the buffer, compressed, pre-scaled, and the buffer's
  allreduce starts while backward goes on. Buckets start strictly in layout
  order on every rank (a ready bucket waits for the ones before it), since
  collectives pair up in the order they are issued: a parameter that gets
  no gradient on some ranks cannot make ranks reduce different buckets.
- `synchronize()` (called by `step()` unless inside `skip_synchronize()`)
  starts the buckets whose gradients never came (as zeros, as Horovod), waits
  for all of them through the abortable core, decompresses, applies the
  average and `gradient_predivide_factor`, and copies the results back into
  `.grad`.
- `op=Adasum` follows Horovod's Adasum optimizer: each rank takes its local
  step, and the parameter deltas are combined with Adasum.

A failed or aborted reduction raises WorkerInternalError from `step()`; the
hooks never raise into backward. Restoring a commit (`load_state_dict`)
drops whatever a failed step left in flight.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from libworker import adasum
from libworker.collectives import finish, launch, waits_on_stream
from libworker.compression import Compression, Compressor
from libworker.errors import WorkerInternalError
from libworker import process_sets
from libworker.mpi_ops import TORCH_OPS, Adasum, Average, ProcessSet, agree, global_process_set, reduce_op
from libworker.negotiation import Signature, TensorSpec

FIRST_BUCKET_BYTES = 1 << 20
_optimizer_numbers = itertools.count()
DEFAULT_FUSION_THRESHOLD = 25 << 20


def fusion_threshold() -> int:
    """Bytes per bucket: ELASTIC_FUSION_THRESHOLD, else HOROVOD_FUSION_THRESHOLD, else 25 MiB."""
    for name in ("ELASTIC_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD"):
        value = os.environ.get(name)
        if value:
            try:
                threshold = int(value)
            except ValueError:
                raise ValueError(f"{name}={value!r} is not a number of bytes") from None
            if threshold < 0:
                raise ValueError(f"{name}={value!r} must not be negative")
            return threshold
    return DEFAULT_FUSION_THRESHOLD


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients travel together in one flat buffer."""

    params: list[torch.Tensor]
    buffer: torch.Tensor
    views: list[torch.Tensor]
    ready: int = 0
    work: Any = None
    sent: torch.Tensor | None = None
    ctx: Any = None
    error: WorkerInternalError | None = None
    sizes: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, params: list[torch.Tensor]) -> Bucket:
        sizes = [p.numel() for p in params]
        buffer = torch.zeros(sum(sizes), dtype=params[0].dtype, device=params[0].device)
        views = [view.view_as(p) for view, p in zip(buffer.split(sizes), params)]
        return cls(params, buffer, views, sizes=sizes)

    def clear(self) -> None:
        self.ready, self.work, self.sent, self.ctx, self.error = 0, None, None, None, None


def layout_buckets(params: list[torch.Tensor], threshold: int, first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Group parameters in reverse order into buckets of one dtype and device: the first up to `first_bytes`, the
    others up to `threshold` bytes (a parameter larger than the cap gets a bucket of its own)."""
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    current_bytes, cap = 0, min(first_bytes, threshold)
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (current_bytes + nbytes > cap or p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(current)
            current, current_bytes, cap = [], 0, threshold
        current.append(p)
        current_bytes += nbytes
    if current:
        buckets.append(current)
    return buckets


def explicit_groups(params: list[torch.Tensor], groups: Any) -> list[list[torch.Tensor]]:
    """Horovod's `groups=`: a number of groups to split the parameters into, or lists of parameters (the others
    travel alone). Each group is then split by dtype and device."""
    if isinstance(groups, int) and not isinstance(groups, bool):
        if groups <= 0:
            raise ValueError("groups should be a positive integer or a list of lists of torch.Tensor")
        count = min(groups, len(params))
        per_group, extra = divmod(len(params), count)
        split, start = [], 0
        for index in range(count):
            end = start + per_group + (1 if index < extra else 0)
            split.append(params[start:end])
            start = end
    elif isinstance(groups, list):
        known = {id(p) for p in params}
        seen: set[int] = set()
        split = []
        for group in groups:
            if not all(isinstance(p, torch.Tensor) for p in group):
                raise ValueError("groups must consist of torch.Tensor")
            if any(id(p) in seen for p in group):
                raise ValueError("A parameter can only appear once in groups")
            seen.update(id(p) for p in group)
            split.append([p for p in group if id(p) in known])
        split += [[p] for p in params if id(p) not in seen]
    else:
        raise ValueError("groups should be a positive integer or a list of lists of torch.Tensor")
    by_kind: list[list[torch.Tensor]] = []
    for group in split:
        kinds: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in group:
            kinds.setdefault((p.dtype, p.device), []).append(p)
        by_kind.extend(kinds.values())
    return [g for g in by_kind if g]


def _check_names(named_parameters: Any, params: list[torch.Tensor]) -> None:
    if named_parameters is None:
        return
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), usually produced by model.named_parameters()")
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}")
    unnamed = {id(p) for p in params} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError(f"named_parameters was specified, but {len(unnamed)} of the optimizer's parameters were not named")


def _nothing_to_confirm() -> None:
    """The step's agreement was reached before its buckets started."""


class _NotAMember(Exception):
    """This rank is not in the optimizer's process set: the step reduces nothing (never raised to the user)."""


def _parameter_names(named_parameters: Any, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, str]:
    """Horovod's `_parameter_names`: each parameter's name, `allreduce.noname.<group>.<index>` when not named."""
    if named_parameters is not None:
        return {p: name for name, p in named_parameters}
    return {p: f"allreduce.noname.{g}.{i}" for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])}


class GradientReducer:
    """The buckets of one optimizer, their hooks, and the reduction of one step.

    Each step starts with one negotiation of the whole bucket layout: on the
    first step of a round in full and before any bucket moves, so a rank whose
    model differs fails on every rank with CollectiveMismatchError; from then
    on as the cached signature's one small allreduce, sent ahead of the first
    bucket without waiting (confirmed in synchronize), so backward never waits
    for it. A rank in `join()` serves the buckets with zeros either way.
    """

    def __init__(self, params: list[torch.Tensor], compression: type[Compressor], backward_passes_per_step: int, op: int,
                 gradient_predivide_factor: float, groups: Any, process_set: ProcessSet, name: str) -> None:
        self.process_set = process_set
        self.name = name
        self.compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.predivide = gradient_predivide_factor
        self.sparse: set[torch.Tensor] = set()
        layout = explicit_groups(params, groups) if groups is not None else layout_buckets(params, fusion_threshold())
        self.buckets = [Bucket.of(group) for group in layout]
        self.signature = self._layout_signature()
        self.group: Any = None
        self.step_error: BaseException | None = None
        self.confirm_step: Any = _nothing_to_confirm
        self.delay = {p: backward_passes_per_step for p in params}
        self.touched = False
        self.next_launch = 0
        self.hooks = []
        for bucket in self.buckets:
            for p in bucket.params:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._hook(bucket)))

    def _hook(self, bucket: Bucket) -> Any:
        def grad_ready(p: torch.Tensor) -> None:
            self.touched = True
            if self.delay[p] <= 0:
                raise AssertionError("Gradients were computed more than backward_passes_per_step times before call to step(). "
                                     "Increase backward_passes_per_step to accumulate gradients locally.")
            self.delay[p] -= 1
            if self.delay[p] == 0:
                bucket.ready += 1
                if bucket.ready == len(bucket.params) and self.op != Adasum:
                    self._launch_ready_in_order()
        return grad_ready

    def _layout_signature(self) -> Signature:
        """The buckets as they travel (after compression): what every rank must agree on before a step."""
        specs = []
        for bucket in self.buckets:
            sent, _ = self.compression.compress(torch.zeros(1, dtype=bucket.buffer.dtype))
            specs.append(TensorSpec(str(sent.dtype).removeprefix("torch."), (bucket.buffer.numel(),)))
        device = "cuda" if self.buckets and self.buckets[0].buffer.is_cuda else "cpu"
        return Signature("optimizer", tuple(specs), self.op, -1, self.predivide, 1.0, device)

    def is_member(self) -> bool:
        """A rank outside the optimizer's process set steps on its own gradients, as in Horovod."""
        return bool(self.process_set.included())

    def _agree_on_step(self) -> None:
        """Before the step's first bucket: the ranks agree on the layout (and joined ranks learn it)."""
        if self.next_launch or self.step_error is not None:
            return
        if not self.is_member():
            self.step_error = _NotAMember()
            return
        self.group = process_sets.group_of(self.process_set)
        try:
            self.confirm_step = agree(self.process_set, self.name, self.signature)
        except (RuntimeError, ValueError) as exc:
            self.step_error = exc

    def _launch_ready_in_order(self) -> None:
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._agree_on_step()
            if self.step_error is not None:
                return
            self._launch(bucket)
            self.next_launch += 1

    def _gradients(self, bucket: Bucket) -> list[torch.Tensor]:
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                self.sparse.add(p)
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        return grads

    def _launch(self, bucket: Bucket) -> None:
        torch._foreach_copy_(bucket.views, self._gradients(bucket))
        if dist.get_world_size(self.group) == 1:
            return
        sent, bucket.ctx = self.compression.compress(bucket.buffer)
        if self.op == Average and self.predivide != 1.0:
            sent.div_(self.predivide)
        bucket.sent = sent
        try:
            bucket.work = launch(lambda: dist.all_reduce(sent, op=TORCH_OPS[self.op], group=self.group, async_op=True))
        except WorkerInternalError as exc:
            bucket.error = exc

    def synchronize(self) -> None:
        """Finish this step's reduction: every bucket's result lands in its parameters' `.grad`."""
        try:
            self._agree_on_step()
            if isinstance(self.step_error, _NotAMember):
                return
            if self.step_error is not None:
                raise self.step_error
            for bucket in self.buckets[self.next_launch :]:
                self._launch(bucket)
            self.next_launch = len(self.buckets)
            self.confirm_step()
            size = dist.get_world_size(self.group)
            for bucket in self.buckets:
                if bucket.error is not None:
                    raise bucket.error
                if bucket.work is None:
                    continue
                finish(bucket.work, waits_on_stream(bucket.buffer))
                result = self.compression.decompress(bucket.sent, bucket.ctx)
                if self.op == Average:
                    result.mul_(self.predivide / size)
                views = bucket.views if result is bucket.buffer else [v.view_as(p) for v, p in zip(result.split(bucket.sizes), bucket.params)]
                torch._foreach_copy_([p.grad for p in bucket.params], views)
            for p in self.sparse:
                p.grad = p.grad.to_sparse()
        finally:
            self.clear()

    def clear(self) -> None:
        for bucket in self.buckets:
            bucket.clear()
        for p in self.delay:
            self.delay[p] = self.backward_passes_per_step
        self.touched = False
        self.next_launch = 0
        self.step_error = None
        self.confirm_step = _nothing_to_confirm
        self.sparse.clear()


class _DistributedOptimizer:
    """Mixed in before the wrapped optimizer's own class: reduces gradients before its step."""

    _reducer: GradientReducer
    _synchronized: bool
    _should_synchronize: bool

    def synchronize(self) -> None:
        """Wait for the gradients' reduction (to clip them, say); then call step() inside skip_synchronize()."""
        if self._reducer.op == Adasum:
            return
        self._reducer.synchronize()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """`step()` inside this block does not synchronize again (after an explicit synchronize())."""
        if self._reducer.op == Adasum:
            raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._reducer.op == Adasum:
            return self._adasum_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). "
                              "This can cause training slowdown.", stacklevel=2)
            self.synchronize()
        self._synchronized = False
        return super().step(closure)  # type: ignore[misc]

    def local_step(self, closure: Any = None) -> Any:
        """The wrapped optimizer's own step, with no reduction."""
        return super().step(closure)  # type: ignore[misc]

    def _adasum_step(self, closure: Any) -> Any:
        """Horovod's Adasum optimizer: a local step, then the parameter deltas of all ranks combined with Adasum."""
        reducer = self._reducer
        params = [p for bucket in reducer.buckets for p in bucket.params]
        try:
            for bucket in reducer.buckets:
                reducer._gradients(bucket)
            starts = [p.detach().clone() for p in params]
            loss = super().step(closure)  # type: ignore[misc]
            group = process_sets.group_of(reducer.process_set)
            if dist.get_world_size(group) > 1:
                with torch.no_grad():
                    compressed = [reducer.compression.compress(p.detach() - start) for p, start in zip(params, starts)]
                    adasum.adasum_([delta for delta, _ in compressed], group)
                    for p, start, (delta, ctx) in zip(params, starts, compressed):
                        p.copy_(start + reducer.compression.decompress(delta, ctx))
            return loss
        finally:
            reducer.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._reducer.touched:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                                 "optimizer.synchronize(). This is prohibited as it can cause a race condition.")
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reducer.clear()
        self._synchronized = False
        self._should_synchronize = True
        super().load_state_dict(state_dict)  # type: ignore[misc]

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self._reducer.backward_passes_per_step = passes
        self._reducer.clear()


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None, compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that its step() applies gradients reduced across the round, or across `process_set`
    (Horovod's signature)."""
    process_sets.registered_id(process_set)
    resolved = reduce_op(op)
    if gradient_predivide_factor != 1.0 and resolved != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if gradient_predivide_factor <= 0:
        raise ValueError("gradient_predivide_factor must be > 0")
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`", DeprecationWarning, stacklevel=2)
        groups = groups if groups is not None else num_groups
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    named_parameters = list(named_parameters) if named_parameters is not None else None
    _check_names(named_parameters, [p for group in optimizer.param_groups for p in group["params"]])
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k not in ("step", "zero_grad")})  # not a scheduler's patch
    wrapped._reducer = GradientReducer(params, compression, backward_passes_per_step, resolved, gradient_predivide_factor, groups,
                                       process_set, f"DistributedOptimizer.{next(_optimizer_numbers)}")
    wrapped._parameter_names = _parameter_names(named_parameters, optimizer)
    wrapped._synchronized = False
    wrapped._should_synchronize = True
    return wrapped
