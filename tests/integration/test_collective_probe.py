"""The collective probe with real agents, probe processes and a job: hosts entering together run one timed
all-reduce; a host slowed on purpose (ELASTIC_PROBE_SLOWDOWN) is held back and named while the job trains on the
others, which pass; a host that enters later is probed alone, judged against the times the hosts in the job had,
and the hosts already in the job are never probed again; bad probe reports are refused."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from elastic_control_plane.bus.client import ServiceError
from elastic_control_plane.elasticctl.local_processes import agent_argv, registered
from testing.harness import Cluster, wait_for
from tests.integration.training import JOB, steps, wait_for_size

PROBE = ["--collective-probe"]
SLOW_HOST = "host-3"


# A 0.5 s heartbeat (lost after 5 s of silence): a machine shared with other suites stalls an agent, and a host lost
# is not what these tests test.
pytestmark = pytest.mark.cluster_env({"ELASTIC_HEARTBEAT": "0.5"})


def start_agent(cluster: Cluster, host: str, env: dict[str, str] | None = None) -> None:
    name = f"agent-{host}"
    cluster.spawn(name, agent_argv(host, 1, *PROBE), {**cluster.env, **(env or {})})
    cluster.group.wait_until(
        lambda: registered(cluster.call("discovery", "hosts"), host), 20, f"agent {host} to register", [name]
    )


def row(cluster: Cluster, name: str) -> dict[str, Any]:
    return next(h for h in cluster.call("discovery", "hosts")["all"] if h["host"] == name)


def probes(cluster: Cluster, event: str) -> list[dict[str, Any]]:
    """Discovery's log lines of `event`."""
    lines = cluster.log_path("discovery").read_text().splitlines()
    return [e for line in lines if line.startswith("{") and (e := json.loads(line)).get("event") == event]


def test_a_slow_host_is_held_back_the_others_enter_and_a_later_host_is_probed_alone(
    cluster: Cluster, tmp_path: Path
) -> None:
    start_agent(cluster, "host-1")
    start_agent(cluster, "host-2")
    start_agent(cluster, SLOW_HOST, {"ELASTIC_PROBE_SLOWDOWN": "0.5"})
    wait_for(
        lambda: (row(cluster, SLOW_HOST)["health_hold"] or "").startswith("collective probe: "),
        90,
        f"{SLOW_HOST} held back by the probe",
    )
    hold = row(cluster, SLOW_HOST)["health_hold"]
    assert row(cluster, SLOW_HOST)["state"] == "unhealthy"
    assert "x the others' median" in hold, hold
    for innocent in ("host-1", "host-2"):
        wait_for(lambda: row(cluster, innocent)["state"] == "active", 30, f"{innocent} admitted")
        assert row(cluster, innocent)["health_hold"] is None
    table = cluster.elasticctl("status").stdout
    assert hold in table, table

    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--min-np", "2", "--", *JOB, "--epochs", "40", "--step-delay", "0.05", "--log-dir", str(log_dir)
    )
    wait_for_size(log_dir, 2)
    assert row(cluster, SLOW_HOST)["state"] == "unhealthy"
    judged_before = len(probes(cluster, "collective_probe_judged"))

    start_agent(cluster, "host-4")
    wait_for_size(log_dir, 3, after=time.time(), timeout=120)
    later = probes(cluster, "collective_probe_started")
    in_job = {"host-1", "host-2"}
    host4_probe = next(e for e in later if "host-4" in e["hosts"])
    assert not in_job & set(host4_probe["hosts"]), f"a host in the job was probed again: {host4_probe}"
    judged = probes(cluster, "collective_probe_judged")[judged_before:]
    assert any("host-4" in e["seconds"] and "host-4" not in e["held"] for e in judged), judged
    assert SLOW_HOST not in {e["host"] for e in steps(log_dir)}, f"{SLOW_HOST} trained though the probe held it"
    cluster.call("registry", "cancel")
    cluster.wait_job_end(job, 60)


def test_a_malformed_probe_report_is_refused_and_changes_nothing(cluster: Cluster) -> None:
    for bad in ("not a map", {"store": 7}, {"store": None, "id": True}, {"store": None, "seconds": -1}):
        health = {"ok": True, "reason": "", "checked_at": 1.0, "request": 0, "next_check": None, "probe": bad}
        body = {"host": "host-9", "slots": 1, "incarnation": "x", "health": health}
        with pytest.raises(ServiceError) as refused:
            cluster.call("discovery", "register", body)
        assert refused.value.code == "bad_request" and "health.probe" in str(refused.value)
    assert "host-9" not in [h["host"] for h in cluster.call("discovery", "hosts")["all"]]


def probe_processes(agent_pid: int) -> list[int]:
    """The agent's children that run the probe process (a child started by a thread is listed under that thread)."""
    children = [
        pid for task in Path(f"/proc/{agent_pid}/task").iterdir() for pid in (task / "children").read_text().split()
    ]
    return [int(pid) for pid in children if b"probe_process" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def test_a_probe_process_that_dies_holds_its_host_is_started_again_and_none_outlives_its_agent(
    cluster: Cluster,
) -> None:
    start_agent(cluster, "host-1")
    agent = cluster.processes["agent-host-1"]
    first = wait_for(lambda: probe_processes(agent.pid), 10, "the agent's probe process")[0]
    os.kill(first, signal.SIGKILL)  # while it imports torch: the host is due for its first probe
    wait_for(
        lambda: "exited (code -9)" in (row(cluster, "host-1")["health_hold"] or ""),
        10,
        "the host held with the reason",
    )
    wait_for(lambda: row(cluster, "host-1")["state"] == "active", 60, "host-1 probed again with a new process")
    second = probe_processes(agent.pid)
    assert second and first not in second
    cluster.stop("agent-host-1")
    wait_for(lambda: not Path(f"/proc/{second[0]}").exists(), 10, "the probe process gone with its agent")
