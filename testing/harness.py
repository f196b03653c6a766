"""The process harness of the integration tests and benchmarks: real services, agents and workers on loopback.

A `Cluster` starts the four services on free ports with shortened intervals;
callers add agents and jobs; `close()` kills everything it started, and
whatever it started dies with the process that started it (a killed test run
or benchmark leaves nothing behind). Its processes are started, waited for and
stopped as `elasticctl local` starts its own (elasticctl/local_processes.py):
the same command lines, the same rule for a registered agent, the same order
of stopping.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from elastic_control_plane.bus.client import Client, incarnation_id
from elastic_control_plane.bus.config import Endpoints
from elastic_control_plane.bus.sockets import Security
from elastic_control_plane.elasticctl.local_processes import (
    SERVICES,
    Processes,
    agent_argv,
    registered,
    service_argv,
)

REPO = Path(__file__).resolve().parents[1]
# What a process logs for each bad message a peer sends; a failed test's log tail shows what else happened.
PER_MESSAGE_NOISE = (
    '"event": "bad_message"',
    '"event": "request_refused"',
    '"event": "unknown_type"',
    '"event": "unexpected_reply"',
)
T = TypeVar("T")

# Heartbeats every 0.2 s, so that what follows from one (a drain, a registration, a crash report) comes fast; a host
# counts as lost after 10 missed (2 s), not 3: on a loaded 2-core machine an agent stalls past 0.6 s, and a host
# lost by accident resets a job whose test is about something else.
FAST_TIMING = {
    "ELASTIC_HEARTBEAT": "0.2",
    "ELASTIC_MISSED_HEARTBEATS": "10",
    "ELASTIC_DISCOVERY_POLL": "0.2",
    "ELASTIC_DRIVER_TICK": "0.05",
    "ELASTIC_COLLECTIVE_TIMEOUT": "20",
}
HOST_LOST_AFTER = float(FAST_TIMING["ELASTIC_HEARTBEAT"]) * int(FAST_TIMING["ELASTIC_MISSED_HEARTBEATS"])


def _ephemeral_range() -> range:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


_EPHEMERAL = _ephemeral_range()
_LISTEN_PORTS = range(20000, min(_EPHEMERAL.start, 32768))
_handed_out: set[int] = set()
_pick = random.Random(os.getpid())


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int) -> list[int]:
    """`count` ports nobody listens on, for servers a test starts.

    They lie below the kernel's ephemeral range, so that no outgoing connection
    (a ZeroMQ client, a gloo peer) is given one as its local port between now and
    the moment its server binds it, and none is handed out twice in this process.
    The CI failure this prevents: a service's port taken before it could bind it.
    """
    ports: list[int] = []
    while len(ports) < count:
        port = _pick.choice(_LISTEN_PORTS)
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            ports.append(port)
    return ports


def wait_for(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `probe` until it returns something truthy; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except Exception as exc:  # a probe may fail while things start
            last_error = exc
        time.sleep(interval)
    raise AssertionError(
        f"timed out after {timeout:g}s waiting for {what}" + (f" (last error: {last_error})" if last_error else "")
    )


def read_events(log_dir: Path) -> list[dict[str, Any]]:
    """All JSON lines the example job's ranks wrote, in time order."""
    events = []
    for path in sorted(log_dir.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    events.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut short by a kill
    return sorted(events, key=lambda e: e["time"])


def processes_with_env(marker: str) -> list[int]:
    """Live processes (not zombies) whose environment contains `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes() and " Z " not in (entry / "stat").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


class Cluster:
    def __init__(self, workdir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        ports = free_ports(5)
        self.endpoints = Endpoints(*(f"tcp://127.0.0.1:{p}" for p in ports))
        self.env = {
            **os.environ,
            **self.endpoints.as_env(),
            **FAST_TIMING,
            "ELASTIC_RUN_DIR": str(workdir / "run"),
            "ELASTIC_SHM_DIR": str(workdir / "shm"),
            "TMPDIR": str(
                workdir / "tmp"
            ),  # what a process keeps in a temporary directory (elasticctl local's logs) goes with the test's
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'examples'}",
            **(extra_env or {}),
        }
        workdir.mkdir(parents=True, exist_ok=True)
        for directory in ("ELASTIC_SHM_DIR", "TMPDIR"):
            Path(self.env[directory]).mkdir(parents=True, exist_ok=True)
        self.group = Processes(cwd=REPO)
        self.processes = self.group.running
        self._client_id = incarnation_id("test")
        self._clients: dict[str, Client] = {}

    def log_path(self, name: str) -> Path:
        return self.workdir / f"{name.replace(' ', '_')}.log"

    def spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return self.group.start(name, args, env or self.env, self.log_path(name))

    def start_services(
        self, extra_args: dict[str, list[str]] | None = None, services: tuple[str, ...] = SERVICES
    ) -> None:
        """Start services (all four by default, or restart some that were killed) and wait until each answers."""
        for service in services:
            self.spawn(service, service_argv(service, *(extra_args or {}).get(service, [])))
        for service in services:
            self.group.wait_until(
                lambda s=service: self.call(s, "ping", timeout=0.5), 20, f"{service} to answer", [service]
            )

    def start_agent(self, host: str, slots: int = 2, extra_args: list[str] | None = None) -> subprocess.Popen[bytes]:
        name = f"agent-{host}"
        process = self.spawn(name, agent_argv(host, slots, *(extra_args or [])))
        self.group.wait_until(
            lambda: registered(self.call("discovery", "hosts"), host), 20, f"agent {host} to register", [name]
        )
        return process

    def client(self, service: str, timeout: float = 2.0) -> Client:
        key = f"{service}/{timeout}"
        if key not in self._clients:
            keys = self.env.get("ELASTIC_KEYS")
            security = Security(keys_dir=Path(keys) if keys else None)
            self._clients[key] = Client(
                getattr(self.endpoints, service), self._client_id, security=security, timeout=timeout, deadline=timeout
            )
        return self._clients[key]

    def call(
        self, service: str, msg_type: str, body: dict[str, Any] | None = None, timeout: float = 2.0
    ) -> dict[str, Any]:
        return self.client(service, timeout).request(msg_type, body or {}).body

    def elasticctl(self, *args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "elastic_control_plane.elasticctl.main", *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def submit(self, *args: str, name: str = "elasticctl-run") -> subprocess.Popen[bytes]:
        """Start `elasticctl run ARGS` in the background (its output goes to a log file)."""
        return self.spawn(name, [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "run", *args])

    def job(self) -> dict[str, Any]:
        return self.call("registry", "job")

    def status(self) -> dict[str, Any]:
        result = self.elasticctl("status", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def wait_job_end(self, process: subprocess.Popen[bytes], timeout: float) -> int:
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"job did not end within {timeout:g}s; job: {self.job()}") from None

    def output(self, name: str) -> str:
        path = self.log_path(name)
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        return self.group.stop(name, sig, timeout)

    def close(self) -> None:
        """Stop everything: the agents killed outright (a test's workers need no drain), then the rest."""
        for client in self._clients.values():
            client.close()
        self.group.stop_all(agents_with=signal.SIGKILL, grace=5.0)

    def leftover_workers(self) -> list[int]:
        """Pids of live worker processes of this cluster's agents (found by their agent endpoint)."""
        return processes_with_env(f"ELASTIC_AGENT=ipc://{self.workdir / 'run'}")

    def dump_logs(self) -> str:
        """The last 40 lines of each process's log, leaving out the lines logged for each bad message a peer sent."""
        parts = []
        for name in self.processes:
            lines = [
                line for line in self.output(name).splitlines() if not any(noise in line for noise in PER_MESSAGE_NOISE)
            ]
            parts.append(f"----- {name} (last 40 lines, bad-message lines left out) -----\n" + "\n".join(lines[-40:]))
        return "\n".join(parts)


def worker_pid(cluster: Cluster, host: str, local_rank: int) -> int:
    def find() -> int | None:
        for worker in cluster.status()["workers"]:
            if worker["host"] == host and worker["local_rank"] == local_rank and worker["state"] == "RUNNING":
                return int(worker["pid"])
        return None

    return wait_for(find, 60, f"a running worker at {host}/{local_rank}")


def rss_bytes(pid: int) -> int:
    """The resident memory of process `pid`, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def serve_in_thread(service: Any) -> Iterator[Any]:
    """A service running its loop in a thread of this process while the generator is suspended; stopped and closed
    after (a fixture's body: `yield from serve_in_thread(service)`)."""
    thread = threading.Thread(target=service.run, daemon=True)
    thread.start()
    try:
        yield service
    finally:
        service.stop()
        thread.join(timeout=5)
        service.close()
