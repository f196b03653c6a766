"""docker-compose.yml without a Docker engine: parse it, then run each service's command locally.

The compose file is checked for shape (services, commands, healthchecks, ports,
dependencies, environment, the keys volume). Then the `keys` service's command
makes the keys into a directory standing for its volume, and every service's
`command` runs as a local process with the compose environment, except that
endpoints point at 127.0.0.1 on free ports, the bind host is 127.0.0.1
(metrics ports too) and `/keys` is that directory; each must answer a ping
made with the operator's share and serve its metrics, each compose healthcheck
(its port rewritten) must exit 0, and a caller without the job's keys (no key,
or a key of its own) gets no answer from any of them.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from elastic_control_plane.bus.client import Client, Unreachable, incarnation_id
from elastic_control_plane.bus.roles import AGENT, OPERATOR
from elastic_control_plane.bus.sockets import SHARES_DIR, Security, generate_keys
from testing.harness import free_ports

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"

SERVICES = ("notifier", "discovery", "rendezvous", "registry")
KEYS_SERVICE, KEYS_VOLUME, KEYS_PATH = "keys", "elastic-keys", "/keys"
# The ROUTER port each service binds (and its healthcheck pings), per bus/config.py.
PORT_OF = {"discovery": 5550, "rendezvous": 5551, "registry": 5552, "notifier": 5553}
EVENTS_PORT = 5554
# The Prometheus port each service serves on (its --metrics-port).
METRICS_PORT_OF = {"discovery": 9550, "rendezvous": 9551, "registry": 9552, "notifier": 9553}
PUBLISHED = {
    "discovery": {5550, 9550},
    "rendezvous": {5551, 9551},
    "registry": {5552, 9552},
    "notifier": {5553, EVENTS_PORT, 9553},
}
ENDPOINT_VARS = {
    "ELASTIC_DISCOVERY_ENDPOINT": ("discovery", 5550),
    "ELASTIC_RENDEZVOUS_ENDPOINT": ("rendezvous", 5551),
    "ELASTIC_REGISTRY_ENDPOINT": ("registry", 5552),
    "ELASTIC_NOTIFIER_ENDPOINT": ("notifier", 5553),
    "ELASTIC_EVENTS_ENDPOINT": ("notifier", EVENTS_PORT),
}
# Services that must wait for another one to be healthy: (dependent, dependency).
HEALTHY_DEPENDENCIES = {
    ("discovery", "notifier"),
    ("registry", "notifier"),
    ("registry", "discovery"),
    ("registry", "rendezvous"),
}

START_DEADLINE = 10.0
STOP_TIMEOUT = 5.0


# -- helpers -------------------------------------------------------------------------------------
def load_compose() -> dict[str, Any]:
    with COMPOSE_FILE.open() as f:
        return yaml.safe_load(f)


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's `environment` (map or KEY=VALUE list) as strings, as compose passes it."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def published_ports(service: dict[str, Any]) -> set[int]:
    """Container ports of `ports` entries ("HOST:CONTAINER", "CONTAINER" or the long form)."""
    ports: set[int] = set()
    for entry in service.get("ports") or []:
        if isinstance(entry, dict):
            ports.add(int(entry["target"]))
        else:
            ports.add(int(str(entry).split(":")[-1].split("/")[0]))
    return ports


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), test
    assert test[0] == "CMD", "healthcheck should use the exec form (no shell in the image needed)"
    return list(test[1:])


def local_argv(argv: list[str], port_map: dict[int, int] | None = None) -> list[str]:
    """A compose command for this machine: "python" is the interpreter running the tests, and a
    `--metrics-port` is moved to its free port in `port_map`."""
    out = [sys.executable if arg in ("python", "python3") else arg for arg in argv]
    for i, arg in enumerate(out[:-1]):
        if arg == "--metrics-port" and port_map is not None:
            out[i + 1] = str(port_map[int(out[i + 1])])
    return out


def rewrite_port(argv: list[str], port_map: dict[int, int]) -> list[str]:
    out = []
    for arg in argv:
        if arg.startswith("tcp://"):
            host, port = arg[len("tcp://") :].rsplit(":", 1)
            arg = f"tcp://{host}:{port_map[int(port)]}"
        out.append(arg)
    return out


def local_environment(
    compose_env: dict[str, str], port_map: dict[int, int], keys_dir: Path, state_dir: Path | None = None
) -> dict[str, str]:
    """The compose environment on this machine: loopback, free ports, the keys volume as `keys_dir`, the state volume
    as `state_dir`; nothing inherited from ELASTIC_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    env.update(compose_env)
    assert env.get("ELASTIC_KEYS") == KEYS_PATH
    env["ELASTIC_KEYS"] = str(keys_dir)
    for var, (_, port) in ENDPOINT_VARS.items():
        env[var] = f"tcp://127.0.0.1:{port_map[port]}"
    env["ELASTIC_BIND"] = "127.0.0.1"
    if "ELASTIC_STATE_DIR" in env:  # the container's volume: a directory of this run's own here
        env.pop("ELASTIC_STATE_DIR")
        if state_dir is not None:
            env["ELASTIC_STATE_DIR"] = str(state_dir)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return env


def start_order(services: dict[str, Any]) -> list[str]:
    """Services in depends_on order (dependencies first), as compose starts them."""
    order: list[str] = []

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"depends_on cycle: {' -> '.join(path + (name,))}"
        if name in order:
            return
        for dep in dependencies(services[name]):
            visit(dep, path + (name,))
        order.append(name)

    for name in services:
        visit(name, ())
    return order


def dependencies(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {d: "service_started" for d in deps}
    return {d: spec.get("condition", "service_started") for d, spec in deps.items()}


def ping(endpoint: str, deadline: float, keys: Path | None, role: str = OPERATOR) -> dict[str, Any]:
    """Ping `endpoint` (as `role`, with the keys in `keys`; None: none) until it answers or `deadline` (monotonic)
    passes."""
    security = Security(keys_dir=keys, role=role)
    client = Client(endpoint, incarnation_id("test-compose"), security=security, timeout=0.25, deadline=0.25)
    try:
        while True:
            try:
                return client.request("ping").body
            except Unreachable:
                if time.monotonic() >= deadline:
                    raise
    finally:
        client.close()


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT)


# -- the compose file ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_compose()


def test_four_services_with_their_commands_and_a_keys_service_that_makes_keys_once(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {*SERVICES, KEYS_SERVICE}
    for name in SERVICES:
        service = services[name]
        assert service["build"] == "."
        assert service["command"] == [
            "python",
            "-m",
            f"elastic_control_plane.services.{name}",
            "--metrics-port",
            str(METRICS_PORT_OF[name]),
        ]
        assert service["restart"] == "unless-stopped"
    keys = services[KEYS_SERVICE]
    assert keys["command"][-4:] == ["generate", KEYS_PATH, "--keep", "--shares"]
    assert keys["volumes"] == [f"{KEYS_VOLUME}:{KEYS_PATH}"] and "restart" not in keys, "it runs once, then exits"


def test_every_service_reads_the_keys_volume_and_cannot_write_it(compose: dict[str, Any]) -> None:
    for name in SERVICES:
        assert f"{KEYS_VOLUME}:{KEYS_PATH}:ro" in compose["services"][name]["volumes"], name
    assert KEYS_VOLUME in compose["volumes"]
    assert f"chown elastic:elastic /state {KEYS_PATH}" in (REPO / "Dockerfile").read_text(), "the keys service writes"


def test_healthchecks_ping_each_service_on_its_own_port(compose: dict[str, Any]) -> None:
    for name in SERVICES:
        argv = healthcheck_argv(compose["services"][name])
        assert argv == ["python", "-m", "elastic_control_plane.bus.ping", f"tcp://127.0.0.1:{PORT_OF[name]}"], name


def test_ports_published_on_loopback(compose: dict[str, Any]) -> None:
    for name in SERVICES:
        service = compose["services"][name]
        assert published_ports(service) == PUBLISHED[name], name
        for entry in service["ports"]:
            address, host, container = str(entry).split(":")
            assert host == container, f"{name}: publish {entry!r} on the same host port"
            assert address == "127.0.0.1", f"{name}: {entry!r}: the quick try's ports stay on this machine"
    every = set().union(*(published_ports(s) for s in compose["services"].values()))
    assert every == {5550, 5551, 5552, 5553, 5554, 9550, 9551, 9552, 9553}


def test_environment_binds_everywhere_with_keys_and_connects_by_service_name(compose: dict[str, Any]) -> None:
    for name in SERVICES:
        env = environment_of(compose["services"][name])
        assert env["ELASTIC_BIND"] == "0.0.0.0", name
        for var, (host, port) in ENDPOINT_VARS.items():
            assert env[var] == f"tcp://{host}:{port}", (name, var)
        assert env["ELASTIC_KEYS"] == KEYS_PATH and "ELASTIC_INSECURE" not in env, f"{name}: secure by default"


def test_the_compose_environment_is_read_as_keys_not_insecure(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic_control_plane.services.notifier.__main__ import main

    env = environment_of(compose["services"]["notifier"])
    for var in [k for k in os.environ if k.startswith("ELASTIC_")]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    params = main.make_context("notifier", []).params
    assert params["bind"] == "0.0.0.0"
    assert params["insecure"] is False and str(params["keys"]) == KEYS_PATH


def test_depends_on_healthy_where_it_matters(compose: dict[str, Any]) -> None:
    services = compose["services"]
    for dependent, dependency in HEALTHY_DEPENDENCIES:
        assert dependencies(services[dependent]).get(dependency) == "service_healthy", (dependent, dependency)
    for name in SERVICES:
        assert dependencies(services[name])[KEYS_SERVICE] == "service_completed_successfully", name
    assert set(dependencies(services["notifier"])) == {KEYS_SERVICE}, "the notifier waits for the keys alone"
    assert start_order(services)[0] == KEYS_SERVICE
    assert start_order(services)[-1] == "registry"


# -- the commands, run locally -------------------------------------------------------------------
def make_keys(compose: dict[str, Any], keys_dir: Path) -> str:
    """The keys service's command, run here with `keys_dir` as its volume; what it printed."""
    argv = [
        str(keys_dir) if arg == KEYS_PATH else arg for arg in local_argv(compose["services"][KEYS_SERVICE]["command"])
    ]
    result = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def keys_volume(compose: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    keys_dir = tmp_path_factory.mktemp("compose-keys") / "keys"
    assert "keys written" in make_keys(compose, keys_dir)
    return keys_dir


@pytest.fixture(scope="module")
def running(
    compose: dict[str, Any], keys_volume: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[dict[str, str], dict[int, int]]]:
    """Start every compose command locally in depends_on order (the keys made), each healthy before its dependents."""
    services = compose["services"]
    logs = tmp_path_factory.mktemp("compose-logs")
    compose_ports = sorted({port for _, port in ENDPOINT_VARS.values()} | set(METRICS_PORT_OF.values()))
    port_map = dict(zip(compose_ports, free_ports(len(compose_ports)), strict=True))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    log_files = []
    endpoints: dict[str, str] = {}
    try:
        for name in [name for name in start_order(services) if name != KEYS_SERVICE]:
            env = local_environment(environment_of(services[name]), port_map, keys_volume, logs / "state")
            log_path = logs / f"{name}.log"
            log_files.append(log_path.open("wb"))
            procs[name] = subprocess.Popen(
                local_argv(services[name]["command"], port_map),
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log_files[-1],
                stderr=subprocess.STDOUT,
            )
            endpoints[name] = f"tcp://127.0.0.1:{port_map[PORT_OF[name]]}"
            deadline = time.monotonic() + START_DEADLINE
            try:
                body = ping(endpoints[name], deadline, keys_volume / SHARES_DIR / OPERATOR)
            except Unreachable:
                stop(procs[name])
                output = log_path.read_text(errors="replace")
                pytest.fail(
                    f"{name} did not answer ping within {START_DEADLINE}s (exit {procs[name].returncode}):\n{output}"
                )
            assert body == {"service": name}
        yield endpoints, port_map
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited early with {proc.returncode}"
    finally:
        for proc in reversed(list(procs.values())):
            stop(proc)
        for f in log_files:
            f.close()


def test_every_service_answers_the_operators_and_the_agents_share(
    running: tuple[dict[str, str], dict[int, int]], keys_volume: Path
) -> None:
    endpoints, _ = running
    deadline = time.monotonic() + START_DEADLINE
    for name in SERVICES:
        for role in (OPERATOR, AGENT):
            assert ping(endpoints[name], deadline, keys_volume / SHARES_DIR / role, role) == {"service": name}, role


def test_a_caller_without_the_jobs_keys_gets_no_answer(
    running: tuple[dict[str, str], dict[int, int]], keys_volume: Path, tmp_path: Path
) -> None:
    """Another user of the machine: in plaintext, or with a keypair of its own and the server's public key (public,
    so assume it known)."""
    endpoints, _ = running
    generate_keys(tmp_path / "own")
    (tmp_path / "own" / "server.key").write_bytes((keys_volume / "server.key").read_bytes())
    for name in SERVICES:
        for keys in (None, tmp_path / "own"):
            with pytest.raises(Unreachable):
                ping(endpoints[name], time.monotonic() + 1.0, keys)


def test_the_keys_service_started_again_keeps_the_keys(compose: dict[str, Any], keys_volume: Path) -> None:
    before = {path.name: path.read_bytes() for path in keys_volume.glob("*.key*")}
    assert "keys kept" in make_keys(compose, keys_volume)
    assert {path.name: path.read_bytes() for path in keys_volume.glob("*.key*")} == before
    agent_share = keys_volume / SHARES_DIR / AGENT
    assert sorted(p.name for p in agent_share.iterdir()) == ["agent.key", "agent.key_secret", "server.key"]


def test_every_service_serves_metrics(running: tuple[dict[str, str], dict[int, int]]) -> None:
    _, port_map = running
    for name in SERVICES:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{port_map[METRICS_PORT_OF[name]]}/metrics", timeout=5
        ) as response:
            text = response.read().decode()
        pings = [
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "elastic_messages_total"
            and sample.labels == {"service": name, "type": "ping", "outcome": "handled"}
        ]
        assert pings and pings[0] >= 1, name


def test_compose_healthchecks_pass(
    compose: dict[str, Any], running: tuple[dict[str, str], dict[int, int]], keys_volume: Path
) -> None:
    _, port_map = running
    for name in SERVICES:
        service = compose["services"][name]
        argv = local_argv(rewrite_port(healthcheck_argv(service), port_map))
        env = local_environment(environment_of(service), port_map, keys_volume)
        result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=10)
        assert result.returncode == 0, f"{name} healthcheck {argv}: {result.stderr}"
        assert result.stdout.strip() == name


def test_healthcheck_fails_when_nothing_listens(compose: dict[str, Any], keys_volume: Path) -> None:
    """The healthcheck is a real check: with no service on the port it exits non-zero."""
    (port,) = free_ports(1)
    service = compose["services"]["rendezvous"]
    argv = local_argv(rewrite_port(healthcheck_argv(service), {PORT_OF["rendezvous"]: port}))
    env = local_environment(environment_of(service), {p: port for _, p in ENDPOINT_VARS.values()}, keys_volume)
    result = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=10)
    assert result.returncode != 0


def test_the_registry_keeps_its_state_on_a_named_volume(compose: dict[str, Any]) -> None:
    registry = compose["services"]["registry"]
    state_dir = environment_of(registry)["ELASTIC_STATE_DIR"]
    assert f"registry-state:{state_dir}" in registry["volumes"]
    assert "registry-state" in compose["volumes"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"chown elastic:elastic {state_dir}" in dockerfile, "the container user can write the volume"


def test_the_image_holds_every_package_the_project_installs() -> None:
    """`pip install .` in the Dockerfile installs what was copied: every folder pyproject.toml installs must be."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {*setuptools["package-dir"].values(), *(p for p in setuptools["packages"] if "." not in p)}
    dockerfile = (REPO / "Dockerfile").read_text()
    missing = [folder for folder in sorted(folders) if f"COPY {folder}/ {folder}/" not in dockerfile]
    assert not missing, f"the Dockerfile does not copy {missing}"


def test_the_images_build_stage_makes_a_wheel_whose_snapshot_copy_is_native(tmp_path: Path) -> None:
    """The Dockerfile's build stage, done here: what it copies, `pip wheel`; installed apart from the repository, the
    agent's snapshot copy is the compiled one, not the pure-Python fallback."""
    dockerfile = (REPO / "Dockerfile").read_text()
    build_stage = dockerfile.split("FROM python:3.11-slim AS build", 1)[1].split("\nFROM ", 1)[0]
    context = tmp_path / "context"
    for copied in re.findall(r"^COPY (.+) \S+$", build_stage, re.M):
        for source in copied.split():
            target = context / source.rstrip("/")
            if (REPO / source).is_dir():
                shutil.copytree(REPO / source, target, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / source, target)
    wheels, installed = tmp_path / "wheels", tmp_path / "installed"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(wheels), str(context)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(installed), str(wheel)], check=True, timeout=300)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import elastic_control_plane.snapshot.copying as c; "
        "print(c.native_available(), c.__file__.startswith(sys.argv[1]))"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    shown = subprocess.run(
        [sys.executable, "-c", probe, str(installed)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert shown.stdout.split() == ["True", "True"], shown.stderr
