"""The bucket layout of DistributedOptimizer: which parameters' gradients travel together, in one flat buffer each.

Buckets are laid out once, in reverse parameter order (the order backward
produces gradients): the first is small (it closes at 1 MiB) so
communication starts early, the others close at the fusion threshold
(`ELASTIC_FUSION_THRESHOLD` or `HOROVOD_FUSION_THRESHOLD` bytes, default 25
MiB; 0 reduces each gradient alone), or follow Horovod's `groups=` when
given. A bucket holds parameters of one dtype and device, and owns one flat
buffer with a view per parameter.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from libworker.errors import WorkerInternalError
from libworker.joining import with_control_element

FIRST_BUCKET_BYTES = 1 << 20
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
    control: bool = False

    @classmethod
    def of(cls, params: list[torch.Tensor], control: bool = False) -> Bucket:
        """A bucket for `params`; with `control`, its buffer also holds the control element that travels with the
        gradients (the first bucket's: how many ranks served the step as joined, libworker.joining)."""
        sizes = [p.numel() for p in params]
        length = with_control_element(sum(sizes)) if control else sum(sizes)
        buffer = torch.zeros(length, dtype=params[0].dtype, device=params[0].device)
        views = [view.view_as(p) for view, p in zip(buffer.narrow(0, 0, sum(sizes)).split(sizes), params)]
        return cls(params, buffer, views, sizes=sizes, control=control)

    def data_of(self, result: torch.Tensor) -> list[torch.Tensor]:
        """The per-parameter views of a reduced buffer (the bucket's own, or a decompressed copy of it)."""
        if result is self.buffer:
            return self.views
        return [v.view_as(p) for v, p in zip(result.narrow(0, 0, sum(self.sizes)).split(self.sizes), self.params)]

    def clear(self) -> None:
        self.ready, self.work, self.sent, self.ctx, self.error = 0, None, None, None, None


def layout_buckets(
    params: list[torch.Tensor], threshold: int, first_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[torch.Tensor]]:
    """Group parameters in reverse order into buckets of one dtype and device, as DDP does: a bucket closes with
    the parameter that brings it to its cap (`first_bytes` for the first, `threshold` for the others), so the
    first one starts with at least `first_bytes` on the wire."""
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    current_bytes, cap = 0, min(first_bytes, threshold)
    for p in reversed(params):
        if current and (p.dtype != current[0].dtype or p.device != current[0].device):
            buckets.append(current)
            current, current_bytes, cap = [], 0, threshold
        current.append(p)
        current_bytes += p.numel() * p.element_size()
        if current_bytes >= cap:
            buckets.append(current)
            current, current_bytes, cap = [], 0, threshold
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
