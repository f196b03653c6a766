"""`elasticctl run --attach RUN`, as a Kubernetes Job's pods use it: a submitter killed mid-job (an evicted pod) and
started again follows the job still running, without a second job or a reset; started again after the job ended, it
reports that end (its exit code) without training again; another run is refused while one trains, as without
--attach; a run name that is not one is refused."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_control_plane.bus.client import ServiceError
from testing.harness import Cluster, wait_for

# Trains until the file RELEASE names exists, then exits 3 (a job's own exit code, passed on by elasticctl run).
SCRIPT = (
    "import os, sys, time, libworker as e; e.init(); e.barrier()\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
    "sys.exit(3)\n"
)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    instance = Cluster(tmp_path)
    try:
        instance.start_services()
        instance.start_agent("host-1", 1)
        yield instance
    finally:
        instance.close()


def test_a_submitter_started_again_follows_its_run_and_never_trains_it_twice(cluster: Cluster, tmp_path: Path) -> None:
    release = tmp_path / "release"
    command = ["--min-np", "1", "--", sys.executable, "-c", SCRIPT, str(release)]
    first = cluster.submit("--attach", "run-a", *command, name="submitter-1")
    wait_for(lambda: cluster.job().get("state") == "running", 60, "the job to run")
    started = cluster.job()
    assert started["run_id"] == "run-a"
    first.send_signal(signal.SIGKILL)  # the pod is evicted: no cancel reaches the registry
    first.wait(timeout=10)
    again = cluster.submit("--attach", "run-a", *command, name="submitter-2")
    wait_for(lambda: "is run run-a already: following it" in cluster.output("submitter-2"), 30, "the attach")
    other = cluster.submit("--attach", "run-b", *command, name="submitter-other")
    assert other.wait(timeout=30) == 1
    assert "is still running; one job at a time" in cluster.output("submitter-other")
    release.touch()
    assert cluster.wait_job_end(again, 60) == 3, cluster.output("submitter-2")
    ended = cluster.job()
    assert (ended["job"], ended["state"], ended["resets"]) == (started["job"], "failed", 0), ended
    late = cluster.submit("--attach", "run-a", *command, name="submitter-3")  # a retry after the end
    assert cluster.wait_job_end(late, 30) == 3, cluster.output("submitter-3")
    assert cluster.job()["job"] == started["job"], "the run was not submitted again"


@pytest.mark.parametrize("run_id", ["x" * 129, 7], ids=["too-long", "not-a-string"])
def test_a_run_name_that_is_not_one_is_refused_and_nothing_is_submitted(cluster: Cluster, run_id: object) -> None:
    spec = {"command": [sys.executable, "-c", "pass"], "min_np": 1}
    with pytest.raises(ServiceError) as refused:
        cluster.call("registry", "submit", {"spec": spec, "run_id": run_id})
    assert refused.value.code == "bad_request" and "run_id must be a string" in refused.value.message
    assert cluster.job()["state"] == "none", "nothing was submitted"
