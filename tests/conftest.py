"""pytest wiring: the `cluster` fixture (services started, torn down even on failure, logs printed when a test
fails), the `slow` marker (skipped unless ELASTIC_SLOW=1), the xdist groups of tests that share a fixed resource,
and a check that the run leaves no snapshot buffer in shared memory."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.harness import Cluster

SHM = Path("/dev/shm")


# Tests that share something fixed run in one xdist group, one after the other (on one worker); every other test has
# its own ports (testing.harness.free_ports), directories and shared-memory directory, and runs beside any other.
SHARED = {
    "tests/slurm/": "slurm",  # one real Slurm per module (its slurmctld and slurmd ports are fixed)
    "tests/integration/test_local_control_hosts.py": "default-ports",  # elasticctl local --control-hosts: 127.0.0.x
    "tests/integration/test_local_privacy.py": "default-ports",  # elasticctl local as users run it, default ports
    "tests/integration/test_partition.py": "netns",  # its namespace's addresses (10.231.0.0/24) are fixed
}


def shared_group(path: str) -> str | None:
    """The xdist group of a test file (a path relative to the repository), or None where it shares nothing."""
    return next((group for prefix, group in SHARED.items() if path.startswith(prefix)), None)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads the groups into each test's id
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(config.rootpath)
    for item in items:
        group = shared_group(Path(item.path).relative_to(root).as_posix())
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
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
