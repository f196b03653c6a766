"""The processes of a control plane and its agents on one machine, as `elasticctl local` (elasticctl/local.py) and
the tests and benchmarks (testing/harness.py) both start them: one command line per service and per agent, one rule
for "an agent has registered", one way to start a process that dies with whoever started it, to wait for it with a
deadline while watching that it did not exit, and to stop everything in order (agents, then services, then etcd).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from elastic_control_plane.bus.lifetime import die_with_parent

SERVICES = ("notifier", "discovery", "rendezvous", "registry")
T = TypeVar("T")


def service_argv(service: str, *args: str) -> list[str]:
    return [sys.executable, "-m", f"elastic_control_plane.services.{service}", *args]


def agent_argv(host: str, slots: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "elastic_control_plane.agent.main", "--host", host, "--slots", str(slots), *args]


def registered(hosts_reply: dict[str, Any], host: str) -> bool:
    """Does discovery's `hosts` reply list `host` as registered (any state but lost)?"""
    return any(row.get("host") == host and row.get("state") != "lost" for row in hosts_reply.get("all") or [])


class StartFailed(RuntimeError):
    """A process exited while it was being waited for, or the wait ran out: the message is one line."""


class Processes:
    """Named processes, each in its own session and killed by the kernel if their starter dies (PR_SET_PDEATHSIG);
    a name started again replaces the process it named."""

    def __init__(self, cwd: Path | None = None) -> None:
        self.cwd = cwd
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.lock = threading.Lock()  # held by whoever starts or stops processes from another thread

    def start(self, name: str, argv: list[str], env: dict[str, str], log: Path | None) -> subprocess.Popen[bytes]:
        """Start `argv` as `name`; its output goes to `log` (appended), or to this process's terminal when None."""
        out = open(log, "ab") if log is not None else None
        try:
            process = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                cwd=self.cwd,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        finally:
            if out is not None:
                out.close()
        self.running[name] = process
        return process

    def wait_until(self, probe: Callable[[], T], timeout: float, what: str, watched: Iterable[str]) -> T:
        """Poll `probe` until it returns something truthy (an exception counts as not yet); StartFailed when one of
        the `watched` processes exits first or after `timeout` seconds."""
        names = list(watched)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name in names:
                process = self.running.get(name)
                if process is not None and process.poll() is not None:
                    raise StartFailed(f"{name} exited with code {process.returncode} while starting")
            try:
                value = probe()
                if value:
                    return value
            except Exception:  # a probe may fail while things start
                pass
            time.sleep(0.05)
        raise StartFailed(f"timed out after {timeout:g}s waiting for {what}")

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Signal one process and reap it; SIGKILL to its session if it outlives `timeout`."""
        process = self.running[name]
        if process.poll() is None:
            process.send_signal(sig)
        return _reap(process, time.monotonic() + timeout)

    def drain_agents(self, grace: float) -> None:
        """SIGTERM to every agent (a drain: its workers leave at their next commit), and a second one to each still
        running after `grace` seconds, which stops its workers now: an agent then still removes its shared-memory
        files and its socket itself, where SIGKILL (a commit longer than the drain's grace) would leave them."""
        with self.lock:
            agents = [process for name, process in self.running.items() if name.startswith("agent")]
        for process in agents:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in agents:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGTERM)

    def stop_all(self, agents_with: int = signal.SIGTERM, grace: float = 10.0) -> None:
        """Agents first (with `agents_with`: SIGTERM drains them, their workers with them), then everything else,
        then etcd, each group with SIGTERM given `grace` seconds before SIGKILL."""
        with self.lock:
            running = list(self.running.items())
        groups = (
            ([p for n, p in running if n.startswith("agent")], agents_with),
            ([p for n, p in running if not n.startswith(("agent", "etcd@"))], signal.SIGTERM),
            ([p for n, p in running if n.startswith("etcd@")], signal.SIGTERM),
        )
        for members, sig in groups:
            for process in members:
                if process.poll() is None:
                    process.send_signal(sig)
            deadline = time.monotonic() + grace
            for process in members:
                _reap(process, deadline)


def _reap(process: subprocess.Popen[bytes], deadline: float) -> int:
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return process.wait()
