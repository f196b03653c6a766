"""Prometheus metrics (issue 10, "Observable"): the four services and an agent started with `--metrics-port`, scraped
over HTTP while a real job runs and after it ends; a bad `--metrics-port` stops a process with one line, exit 2."""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from elastic_control_plane.bus.client import ServiceError
from testing.harness import SERVICES, Cluster, free_ports, wait_for

COUNTER_JOB = [sys.executable, "tests/workers/counter.py", "--batches", "150", "--step-delay", "0.02"]
IN_USE = "--metrics-port='{port}': cannot serve metrics on 127.0.0.1:{port}: Address already in use"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """Every sample served on `port`, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def handled(samples: Samples, service: str, msg_type: str) -> float:
    return value(samples, "elastic_messages_total", service=service, type=msg_type, outcome="handled") or 0.0


def test_services_and_agent_serve_their_metrics_during_a_job(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    *service_ports, agent_port = free_ports(len(SERVICES) + 1)
    port = dict(zip(SERVICES, service_ports, strict=True))
    try:
        cluster.start_services({name: ["--metrics-port", str(port[name])] for name in SERVICES})
        cluster.start_agent("host-1", 2, ["--metrics-port", str(agent_port)])
        job = cluster.submit("--", *COUNTER_JOB)

        agent = wait_for(
            lambda: (
                (s := scrape(agent_port))
                and value(s, "elastic_agent_workers", host="host-1", state="running") == 2
                and value(s, "elastic_agent_workers", host="host-1", state="standby") == 1
                and s
            ),
            60,
            "the agent's metrics to show 2 running workers and the fork server's default standby",
        )
        assert handled(agent, "agent", "rank_and_size") >= 2
        assert (
            value(agent, "elastic_client_requests_in_flight", service="agent", endpoint=cluster.endpoints.discovery)
            is not None
        )
        assert value(agent, "elastic_parked_requests", service="agent") is not None
        commits = wait_for(
            lambda: value(scrape(agent_port), "elastic_commit_seconds_count", host="host-1"),
            30,
            "the snapshot writer's commit times",
        )
        assert commits >= 1
        assert cluster.wait_job_end(job, 60) == 0, cluster.output("elasticctl-run")

        for name in SERVICES:
            samples = scrape(port[name])
            assert handled(samples, name, "ping") >= 1, name
            assert value(samples, "elastic_parked_requests", service=name) is not None, name
            assert value(samples, "elastic_reply_cache_entries", service=name) >= 1, name

        discovery = wait_for(
            lambda: (s := scrape(port["discovery"])) and value(s, "elastic_discovery_hosts", state="active") == 1 and s,
            10,
            "discovery's metrics to show 1 active host",
        )
        assert handled(discovery, "discovery", "heartbeat") > 0
        assert value(discovery, "elastic_discovery_heartbeats_total", status="ok") > 0
        for state in ("lost", "draining", "blacklisted", "warming", "unlisted", "unhealthy"):
            assert value(discovery, "elastic_discovery_hosts", state=state) == 0, state
        registry = scrape(port["registry"])
        assert handled(registry, "registry", "submit") == 1
        assert value(registry, "elastic_registry_job_state", state="succeeded") == 1
        assert value(registry, "elastic_registry_job_state", state="running") == 0
        assert value(registry, "elastic_registry_rounds_started_total") == 1
        assert value(registry, "elastic_registry_resets_total", cause="worker_failed") == 0
        assert value(registry, "elastic_registry_recovery_seconds_count") == 0
        assert value(registry, "elastic_registry_workers", state="success") == 2
        assert handled(scrape(port["notifier"]), "notifier", "publish") >= 2
        assert handled(scrape(port["rendezvous"]), "rendezvous", "new_round") >= 1
        agent = scrape(agent_port)
        assert handled(agent, "agent", "committed") == value(agent, "elastic_commit_seconds_count", host="host-1")
    finally:
        cluster.close()


def test_unknown_and_malformed_messages_share_one_label_value(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    (metrics_port,) = free_ports(1)
    try:
        cluster.start_services({"rendezvous": ["--metrics-port", str(metrics_port)]})
        for msg_type in ("no_such_type", "another_one"):
            with pytest.raises(ServiceError):
                cluster.call("rendezvous", msg_type)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(cluster.endpoints.rendezvous)
        sock.send_multipart([b"not msgpack", b""])
        assert sock.poll(5000), "no answer to a malformed message"
        sock.close(linger=0)
        ctx.term()
        samples = scrape(metrics_port)
        assert value(samples, "elastic_messages_total", service="rendezvous", type="unknown", outcome="refused") == 2
        assert value(samples, "elastic_messages_total", service="rendezvous", type="unknown", outcome="malformed") == 1
        types = {dict(labels)["type"] for name, labels in samples if name == "elastic_messages_total"}
        assert not types & {"no_such_type", "another_one"}
    finally:
        cluster.close()


def _taken_port() -> tuple[socket.socket, int]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    return listener, listener.getsockname()[1]


@pytest.mark.parametrize(
    ("command", "port", "expected"),
    [
        (
            ["-m", "elastic_control_plane.services.rendezvous"],
            "70000",
            "rendezvous: --metrics-port='70000': port 70000 is out of range (1-65535)",
        ),
        (
            ["-m", "elastic_control_plane.services.registry"],
            "metrics",
            "registry: --metrics-port='metrics': not a port number",
        ),
        (["-m", "elastic_control_plane.services.discovery"], "taken", f"discovery: {IN_USE}"),
        (
            ["-m", "elastic_control_plane.agent.main", "--host", "host-1", "--slots", "1"],
            "taken",
            f"elastic-agent: {IN_USE}",
        ),
    ],
    ids=["out-of-range", "not-a-number", "taken", "taken-by-the-agent"],
)
def test_a_bad_metrics_port_stops_the_process_with_one_line(
    tmp_path: Path, command: list[str], port: str, expected: str
) -> None:
    cluster = Cluster(tmp_path)
    listener, taken = _taken_port()
    try:
        port = str(taken) if port == "taken" else port
        result = subprocess.run(
            [sys.executable, *command, "--metrics-port", port],
            env=cluster.env,
            capture_output=True,
            text=True,
            timeout=30,
        )
    finally:
        listener.close()
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [expected.format(port=port)]
