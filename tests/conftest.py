"""pytest wiring: the `cluster` fixture (services started, torn down even on failure, logs printed when a test
fails), the `slow` marker (skipped unless ELASTIC_SLOW=1), the tests that share a fixed resource (one pytest-xdist
worker runs each group, first, under its lock), and a check that the run leaves no snapshot buffer in shared memory."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from testing.harness import Cluster

SHM = Path("/dev/shm")


# Tests that share something fixed run as one unit of work on one pytest-xdist worker (`SharedResourceScheduling`),
# and take its lock for each module (`shared_resource`), so that a second copy of the suite on the machine waits too.
# Every other test has its own ports (testing.harness.free_ports), directories and shared-memory directory, and runs
# beside any other. (Not xdist's `xdist_group`: pytest-xdist 3.8 sets a test id pytest 9 no longer reads, so its
# groups are not kept together.)
SHARED = {
    "tests/slurm/": "slurm",  # one real Slurm per module (its slurmctld and slurmd ports are fixed)
    "tests/integration/test_local_control_hosts.py": "default-ports",  # elasticctl local --control-hosts: 127.0.0.x
    "tests/integration/test_local_privacy.py": "default-ports",  # elasticctl local as users run it, default ports
    "tests/integration/test_partition.py": "netns",  # its namespace's addresses (10.231.0.0/24) are fixed
}


def shared_group(path: str) -> str | None:
    """What a test file (a path relative to the repository) shares with others, or None where it shares nothing."""
    return next((group for prefix, group in SHARED.items() if path.startswith(prefix)), None)


@pytest.fixture(scope="module", autouse=True)
def shared_resource(request: pytest.FixtureRequest) -> Iterator[None]:
    """The lock of what this module shares (SHARED), held from before its first fixture to after its last."""
    group = shared_group(Path(request.path).relative_to(request.config.rootpath).as_posix())
    if group is None:
        yield
        return
    with open(Path(tempfile.gettempdir()) / f"elastic-tests-{group}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# The order work is handed out in: the groups first (one of them runs for minutes on its worker while the others
# share the rest), then the tests that start processes, the fast ones last to fill the gaps at the end.
FIRST = ("tests/slurm/", *SHARED, "tests/integration/", "tests/deploy/")


def start_order(path: str) -> int:
    return next((rank for rank, prefix in enumerate(FIRST) if path.startswith(prefix)), len(FIRST))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class SharedResourceScheduling(LoadScopeScheduling):  # type: ignore[misc]
        """Each test is a unit of work of its own, but a group of SHARED is one unit: one worker runs it whole."""

        def _split_scope(self, nodeid: str) -> str:
            group = shared_group(nodeid.split("::", 1)[0])
            return f"shared:{group}" if group is not None else nodeid

    return SharedResourceScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: start_order(Path(item.path).relative_to(config.rootpath).as_posix()))
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
