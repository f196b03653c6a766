"""pytest wiring: the `cluster` fixture (services started, torn down even on failure, logs printed when a test
fails), the `slow` marker (skipped unless ELASTIC_SLOW=1), and a check that the run leaves no snapshot buffer in
shared memory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.harness import Cluster

SHM = Path("/dev/shm")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("ELASTIC_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow soak/scale run: set ELASTIC_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def no_snapshot_left_in_shared_memory() -> Iterator[None]:
    """Snapshots of this run go to a directory of its own in /dev/shm (ELASTIC_SHM_DIR, inherited by every process
    it starts), so a second copy of the suite or a job running beside it is never taken for a leak of this one."""
    directory = Path(tempfile.mkdtemp(prefix="elastic-test-", dir=SHM))
    os.environ["ELASTIC_SHM_DIR"] = str(directory)
    yield
    left = sorted(str(p) for p in directory.glob("elastic-snapshot-*"))
    shutil.rmtree(directory, ignore_errors=True)
    assert not left, f"snapshot buffers left in {directory} by this test run: {left}"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    """Services started for the test; `@pytest.mark.cluster_env({...})` on a test or module adds to their
    environment."""
    marker = request.node.get_closest_marker("cluster_env")
    instance = Cluster(tmp_path, marker.args[0] if marker is not None else None)
    try:
        instance.start_services()
        yield instance
    finally:
        instance.close()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(instance.dump_logs())
