"""The probes a kubelet sends, against a real agent and services: the agent is not ready before it has registered with
discovery (no control plane yet) and becomes ready once registered with its workers' interpreter warm, alive
throughout; each service answers /healthz while its loop turns, and its metrics on the same port."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from elastic_control_plane.elasticctl.local_processes import agent_argv
from testing.harness import Cluster, free_ports, wait_for


def probe(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as answer:
            return answer.status, answer.read().decode().strip()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode().strip()
    except OSError:
        return 0, "no answer"


def test_an_agent_is_ready_once_registered_and_warm_and_services_are_alive(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        agent_port, *service_ports = free_ports(5)
        cluster.spawn("agent-host-1", agent_argv("host-1", 1, "--metrics-port", str(agent_port)))
        wait_for(lambda: probe(agent_port, "/healthz") == (200, "ok"), 30, "the agent to answer its liveness probe")
        wait_for(lambda: probe(agent_port, "/readyz") == (503, "not registered with discovery"), 30, "not ready")
        services = ("notifier", "discovery", "rendezvous", "registry")
        cluster.start_services({name: ["--metrics-port", str(port)] for name, port in zip(services, service_ports)})
        wait_for(lambda: probe(agent_port, "/readyz") == (200, "ok"), 60, "the agent to be ready")
        for port in service_ports:
            assert probe(port, "/healthz") == (200, "ok")
            status, text = probe(port, "/metrics")
            assert status == 200 and "elastic_messages_total" in text
    finally:
        cluster.close()
