"""The Slurm tests' cluster: one real 3-node Slurm per test module (scripts/slurm.sh), stopped after it even when a
test fails; each test gets it back with every job cancelled and every node idle, and a user directory of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.slurm_cluster import SlurmCluster, running_slurm


@pytest.fixture(scope="module")
def slurm_running() -> Iterator[None]:
    with running_slurm():
        yield


@pytest.fixture
def slurm(slurm_running: None, tmp_path: Path) -> Iterator[SlurmCluster]:
    cluster = SlurmCluster(tmp_path / "user")
    try:
        yield cluster
    finally:
        cluster.reset()
