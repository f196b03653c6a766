"""What an operator sees when an endpoint is wrong or unreachable, and what a killed `elasticctl local` leaves.

A bad endpoint (flag, `ELASTIC_CONTROL`, `ELASTIC_*_ENDPOINT`, compose
environment) stops the CLI, each service and the agent with one line naming
the setting and the value, exit 2. An agent whose control plane is not there
warns once, naming where it tries, and says when it gets through; a worker
does the same for its agent. A SIGKILLed `elasticctl local` takes its
services, agents and workers with it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic_control_plane.agent.agent import agent_endpoint
from elastic_control_plane.elasticctl.local_processes import agent_argv
from testing.harness import REPO, SERVICES, Cluster, processes_with_env, wait_for

BAD_PORT = "tcp://127.0.0.1:70000"


def _clean_env(**extra: str) -> dict[str, str]:
    """This machine's environment without any ELASTIC_* setting, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}, "PYTHONPATH": str(REPO), **extra}


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=30)


def _assert_one_line(result: subprocess.CompletedProcess[str], line: str, exit_code: int = 2) -> None:
    assert result.returncode == exit_code, (result.returncode, result.stderr)
    assert result.stderr.strip().splitlines() == [line], result.stderr
    assert "Traceback" not in result.stdout + result.stderr


def _log_events(cluster: Cluster, name: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines of process `name` whose event is `event`."""
    found = []
    for line in cluster.output(name).splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("event") == event:
                found.append(record)
    return found


# -- elasticctl ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            ["status"],
            {"ELASTIC_REGISTRY_ENDPOINT": "not-an-endpoint"},
            "ELASTIC_REGISTRY_ENDPOINT='not-an-endpoint': not an endpoint (want tcp://HOST:PORT or ipc://PATH)",
        ),
        (
            ["drain", "host-1"],
            {"ELASTIC_DISCOVERY_ENDPOINT": BAD_PORT},
            f"ELASTIC_DISCOVERY_ENDPOINT='{BAD_PORT}': port 70000 is out of range (1-65535)",
        ),
        (
            ["status", "--control", "tcp://10.0.0.1:5550"],
            {},
            "--control='tcp://10.0.0.1:5550': 'tcp://10.0.0.1:5550' is not a host name or an IP address",
        ),
        (
            ["run", "--", "true"],
            {"ELASTIC_CONTROL": "a b"},
            "ELASTIC_CONTROL='a b': 'a b' is not a host name or an IP address",
        ),
        (
            ["local", "--hosts", "1", "--", "true"],
            {"ELASTIC_EVENTS_ENDPOINT": "udp://127.0.0.1:5554"},
            "ELASTIC_EVENTS_ENDPOINT='udp://127.0.0.1:5554': scheme 'udp' is not supported (want tcp://HOST:PORT or ipc://PATH)",
        ),
    ],
)
def test_cli_bad_endpoint_is_one_line_exit_2(args: list[str], env: dict[str, str], line: str) -> None:
    result = _run(["-m", "elastic_control_plane.elasticctl.main", *args], _clean_env(**env))
    _assert_one_line(result, f"elasticctl: {line}")


def test_cli_says_a_control_host_does_not_resolve() -> None:
    result = _run(
        ["-m", "elastic_control_plane.elasticctl.main", "status", "--control", "not-a-host.invalid"], _clean_env()
    )
    _assert_one_line(
        result, "elasticctl: cannot reach the control plane: not-a-host.invalid does not resolve", exit_code=1
    )


# -- services ------------------------------------------------------------------------------------
@pytest.mark.parametrize("service", SERVICES)
def test_each_service_refuses_a_bad_endpoint(service: str) -> None:
    setting = f"ELASTIC_{service.upper()}_ENDPOINT"
    result = _run(["-m", f"elastic_control_plane.services.{service}"], _clean_env(**{setting: BAD_PORT}))
    _assert_one_line(result, f"{service}: {setting}='{BAD_PORT}': port 70000 is out of range (1-65535)")


def test_a_bad_value_in_the_compose_environment_stops_the_service() -> None:
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    registry = compose["services"]["registry"]
    env = {str(k): str(v) for k, v in registry["environment"].items()}
    env["ELASTIC_RENDEZVOUS_ENDPOINT"] = "tcp://rendezvous"
    result = _run(registry["command"][1:], _clean_env(**env))
    _assert_one_line(result, "registry: ELASTIC_RENDEZVOUS_ENDPOINT='tcp://rendezvous': no port (want tcp://HOST:PORT)")


def test_a_bad_bind_host_stops_the_service() -> None:
    result = _run(["-m", "elastic_control_plane.services.notifier"], _clean_env(ELASTIC_BIND="0.0.0.0:5553"))
    _assert_one_line(
        result, "notifier: ELASTIC_BIND='0.0.0.0:5553': '0.0.0.0:5553' is not a host name or an IP address"
    )


@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (
            ["--kubernetes-selector", "app=elastic"],
            {},
            "--kubernetes-selector needs the Kubernetes API: not in a pod, and ELASTIC_KUBERNETES_API is unset",
        ),
        (
            [],
            {"ELASTIC_KUBERNETES_SELECTOR": "app=elastic,", "ELASTIC_KUBERNETES_API": "http://127.0.0.1:1"},
            "--kubernetes-selector='app=elastic,': not a label selector (want key=value[,key=value...])",
        ),
        (
            ["--kubernetes-selector", "app=elastic"],
            {"ELASTIC_KUBERNETES_API": "127.0.0.1:8001"},
            "ELASTIC_KUBERNETES_API='127.0.0.1:8001': not http://HOST:PORT or https://HOST:PORT",
        ),
    ],
)
def test_discovery_refuses_a_kubernetes_source_it_cannot_use(args: list[str], env: dict[str, str], line: str) -> None:
    clean = {k: v for k, v in _clean_env(**env).items() if not k.startswith("KUBERNETES_")}
    _assert_one_line(_run(["-m", "elastic_control_plane.services.discovery", *args], clean), f"discovery: {line}")


# -- the agent -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "env", "line"),
    [
        (["--control", "not a host"], {}, "--control='not a host': 'not a host' is not a host name or an IP address"),
        (
            [],
            {"ELASTIC_CONTROL": "host:70000"},
            "ELASTIC_CONTROL='host:70000': port '70000' of 'host:70000' is not a number from 1 to 65531 (the first of "
            "five)",
        ),
        (
            [],
            {"ELASTIC_NOTIFIER_ENDPOINT": BAD_PORT},
            f"ELASTIC_NOTIFIER_ENDPOINT='{BAD_PORT}': port 70000 is out of range (1-65535)",
        ),
    ],
)
def test_agent_refuses_a_bad_endpoint(tmp_path: Path, args: list[str], env: dict[str, str], line: str) -> None:
    result = _run(
        ["-m", "elastic_control_plane.agent.main", "--host", "h", "--slots", "1", *args],
        _clean_env(ELASTIC_RUN_DIR=str(tmp_path), **env),
    )
    _assert_one_line(result, f"elastic-agent: {line}")


def test_agent_warns_once_then_says_when_a_late_control_plane_answers(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.spawn(
            "agent-host-1",
            agent_argv("host-1", 1),
        )
        (warning,) = wait_for(
            lambda: _log_events(cluster, "agent-host-1", "control_plane_unreachable"), 10, "the agent's warning"
        )
        assert warning["level"] == "warning" and warning["reason"] == "no reply"
        assert warning["endpoints"] == cluster.endpoints.values()
        cluster.start_services()
        (recovery,) = wait_for(
            lambda: _log_events(cluster, "agent-host-1", "control_plane_reachable"), 10, "the agent's recovery line"
        )
        assert recovery["endpoint"] == cluster.endpoints.discovery and recovery["silent_s"] >= warning["silent_s"]
        wait_for(
            lambda: [h for h in cluster.call("discovery", "hosts")["all"] if h["host"] == "host-1"],
            10,
            "the agent to register",
        )
        assert len(_log_events(cluster, "agent-host-1", "control_plane_unreachable")) == 1
    finally:
        cluster.close()


def test_agent_says_its_control_host_does_not_resolve(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    env = {k: v for k, v in cluster.env.items() if not k.endswith("_ENDPOINT")}
    try:
        cluster.spawn(
            "agent-host-1",
            agent_argv("host-1", 1, "--control", "not-a-host.invalid", "--insecure"),  # no keys, off loopback
            env=env,
        )
        (warning,) = wait_for(
            lambda: _log_events(cluster, "agent-host-1", "control_plane_unreachable"), 10, "the agent's warning"
        )
        assert warning["reason"] == "not-a-host.invalid does not resolve"
        assert "tcp://not-a-host.invalid:5550" in warning["endpoints"]
        assert cluster.processes["agent-host-1"].poll() is None
    finally:
        cluster.close()


def test_worker_warns_while_its_agent_is_silent_and_says_when_it_answers(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    endpoint = agent_endpoint(tmp_path / "run", "host-1")
    worker = (
        "import time; from slot_processes.agent_link import AgentLink; "
        f"AgentLink({endpoint!r}, 'host-1', 0, 60.0); time.sleep(60)"
    )
    try:
        cluster.spawn("worker", [sys.executable, "-c", worker])
        warning = re.compile(
            rf"^libworker: no word from the agent at {re.escape(endpoint)} for \d+s; still trying", re.M
        )
        wait_for(lambda: warning.search(cluster.output("worker")), 20, "the worker's warning")
        cluster.spawn(
            "agent-host-1",
            agent_argv("host-1", 1),
        )
        wait_for(
            lambda: f"libworker: the agent at {endpoint} answers again after" in cluster.output("worker"),
            10,
            "the worker's recovery line",
        )
        assert len(warning.findall(cluster.output("worker"))) == 1
    finally:
        cluster.close()


# -- elasticctl local ----------------------------------------------------------------------------
def test_sigkill_of_elasticctl_local_leaves_none_of_its_processes(tmp_path: Path) -> None:
    marker = f"ELASTIC_TEST_RUN={uuid.uuid4().hex}"
    key, value = marker.split("=")
    cluster = Cluster(tmp_path, {key: value})
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    try:
        local = cluster.spawn(
            "local",
            [
                sys.executable,
                "-m",
                "elastic_control_plane.elasticctl.main",
                "local",
                "--hosts",
                "2",
                "--slots",
                "1",
                "--",
                *sleeper,
            ],
        )
        wait_for(lambda: len(cluster.leftover_workers()) == 2, 30, "both workers of the job to run")
        assert len(processes_with_env(marker)) == 1 + len(SERVICES) + 2 + 2 + 2, (
            "elasticctl, the services, 2 agents, their fork servers, 2 workers"
        )
        local.send_signal(signal.SIGKILL)
        local.wait()
        wait_for(lambda: not processes_with_env(marker), 5, "every process of elasticctl local to exit")
    finally:
        cluster.close()
        for pid in processes_with_env(marker):
            os.kill(pid, signal.SIGKILL)
