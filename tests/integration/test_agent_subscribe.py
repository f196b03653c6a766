"""Only the agent's own processes hear its events and heartbeats.

A process that is not one of the agent's workers or standbys, and does not run under one, is refused its
`subscribe` with `not_a_worker` (it used to be given a route, one per pid it named, kept until that pid was reaped:
a stranger on the socket grew the agent's map and heard every event). The innocent beside it: a worker behind a
shell that does not exec and a standby both subscribe, and their job ends well.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from elastic_control_plane.agent.agent import agent_endpoint
from elastic_control_plane.bus.client import Client, ServiceError
from testing.harness import Cluster

REFUSED = "refused this process's events"


def test_a_process_that_is_not_the_agents_is_refused_its_events(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 1)
    client = Client(agent_endpoint(Path(cluster.env["ELASTIC_RUN_DIR"]), "host-1"), "stranger", timeout=2, deadline=10)
    try:
        for pid in (os.getpid(), 2**22 + 1):
            with pytest.raises(ServiceError) as refused:
                client.request("subscribe", {"pid": pid, "local_rank": 0})
            assert refused.value.code == "not_a_worker", refused.value.message
    finally:
        client.close()


def test_a_wrapped_worker_and_a_standby_hear_their_agent(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 2, ["--standby", "1"])
    script = "import libworker as e; e.init(); e.barrier(); print('trained', e.rank(), flush=True)"
    wrapped = f'{sys.executable} -c "{script}"; status=$?; exit $status'
    job = cluster.submit("--min-np", "2", "--", "sh", "-c", wrapped)
    assert cluster.wait_job_end(job, 60) == 0, cluster.output("elasticctl-run")
    output = cluster.output("agent-host-1")
    assert "trained 0" in output and "trained 1" in output, output
    assert "standby_started" in output, "the job ran with a standby beside its workers"
    assert REFUSED not in output, output
