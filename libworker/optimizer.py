"""`DistributedOptimizer`: Horovod's optimizer contract, with DDP's mechanics for reducing gradients.

`hvd.DistributedOptimizer(opt, named_parameters=..., compression=..., op=...,
backward_passes_per_step=..., gradient_predivide_factor=..., groups=...)`
returns the same optimizer as an instance of a subclass of its own class
(`isinstance(opt, torch.optim.SGD)` still holds; its state and param_groups
are the original's). Its gradients are laid out in buckets
(libworker.buckets) and reduced across the round, or across `process_set`,
by a GradientReducer (libworker.gradient_reducer) while backward runs;
`step()` waits for the reduction first (`synchronize()`), unless inside
`skip_synchronize()`. `op=Adasum` follows Horovod's Adasum optimizer: each
rank takes its local step, and the parameter deltas are combined with
Adasum.

A failed or aborted reduction raises WorkerInternalError from `step()`.
Restoring a commit (`load_state_dict`) drops whatever a failed step left in
flight.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from libworker import adasum, process_sets
from libworker.buckets import explicit_groups, fusion_threshold, layout_buckets
from libworker.compression import Compression, Compressor
from libworker.gradient_reducer import GradientReducer
from libworker.process_sets import ProcessSet, global_process_set
from libworker.reduction import Adasum, Average, reduce_op

_optimizer_numbers = itertools.count()


def _check_names(named_parameters: Any, params: list[torch.Tensor]) -> None:
    if named_parameters is None:
        return
    named = list(named_parameters)
    if any(not isinstance(item, tuple) for item in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()"
        )
    names = [name for name, _ in named]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(duplicates)}"
        )
    unnamed = {id(p) for p in params} - {id(p) for _, p in named}
    if unnamed:
        raise ValueError(
            f"named_parameters was specified, but {len(unnamed)} of the optimizer's parameters were not named"
        )


def _parameter_names(named_parameters: Any, optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, str]:
    """Horovod's `_parameter_names`: each parameter's name, `allreduce.noname.<group>.<index>` when not named."""
    if named_parameters is not None:
        return {p: name for name, p in named_parameters}
    return {
        p: f"allreduce.noname.{g}.{i}"
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
    }


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
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(). "
                    "This can cause training slowdown.",
                    stacklevel=2,
                )
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
                reducer.gradients(bucket)
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
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
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


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
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
    name = f"DistributedOptimizer.{next(_optimizer_numbers)}"
    layout = explicit_groups(params, groups) if groups is not None else layout_buckets(params, fusion_threshold())
    cls = type(optimizer.__class__.__name__, (_DistributedOptimizer, optimizer.__class__), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(
        {k: v for k, v in optimizer.__dict__.items() if k not in ("step", "zero_grad")}
    )  # not a scheduler's patch
    wrapped._reducer = GradientReducer(
        params, layout, compression, backward_passes_per_step, resolved, gradient_predivide_factor, process_set, name
    )
    wrapped._parameter_names = _parameter_names(named_parameters, optimizer)
    wrapped._synchronized = False
    wrapped._should_synchronize = True
    return wrapped
