"""Horovod's `SyncBatchNorm`, which libworker does not provide: constructing one says so and names the alternative."""

from __future__ import annotations

from typing import Any


class SyncBatchNorm:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "hvd.SyncBatchNorm is not supported by libworker; use torch.nn.BatchNorm (per-rank statistics)"
        )
