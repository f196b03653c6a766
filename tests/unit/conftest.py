"""Fixtures of the unit tests: a one-rank world (a joined slot and a gloo group of one) for libworker's logic."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from libworker.world import world


@pytest.fixture
def one_rank_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(
        world,
        "slot",
        {
            "rank": 0,
            "size": 1,
            "local_rank": 0,
            "local_size": 1,
            "cross_rank": 0,
            "cross_size": 1,
            "round": 1,
            "hosts_timestamp": 100.0,
            "hostname": "h",
        },
    )
    monkeypatch.setattr(world, "round", 1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        yield
    finally:
        dist.destroy_process_group()
