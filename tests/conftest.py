"""pytest wiring: the `cluster` fixture (services started, torn down even on failure, logs printed when a test
fails), the `slow` marker (skipped unless ELASTIC_SLOW=1), and a check that the run leaves no snapshot slot in
/dev/shm."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Cluster

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
    before = set(SHM.glob("elastic-snapshot-*"))
    yield
    left = sorted(str(p) for p in set(SHM.glob("elastic-snapshot-*")) - before)
    assert not left, f"snapshot slots left in {SHM} by this test run: {left}"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


@pytest.fixture
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    instance = Cluster(tmp_path)
    try:
        instance.start_services()
        yield instance
    finally:
        instance.close()
        report = getattr(request.node, "rep_call", None)
        if report is not None and report.failed:
            print(instance.dump_logs())
