"""CURVE on every TCP socket, refusal of unknown keys, owner-only ipc sockets, and keys that stay with the agent
(no worker, forked or spawned, inherits ELASTIC_KEYS)."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastic_control_plane.bus.client import Client, Unreachable
from elastic_control_plane.bus.sockets import Security, generate_keys
from testing.harness import REPO, SERVICES, Cluster, wait_for, worker_pid
from tests.integration.training import JOB, assert_training_invariants, steps, wait_for_size


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "keys", "generate", str(tmp_path / "keys")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return tmp_path / "keys"


def test_generated_secret_keys_are_owner_only(keys: Path) -> None:
    for secret in keys.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert (keys / "authorized" / "client.key").exists()
    etcd = keys / "etcd"  # etcd's CA, its members' and its clients' certificates
    assert sorted(p.name for p in etcd.iterdir()) == [
        "ca.crt",
        "ca.key",
        "client.crt",
        "client.key",
        "server.crt",
        "server.key",
    ]
    assert all(stat.S_IMODE((etcd / f"{name}.key").stat().st_mode) == 0o600 for name in ("ca", "client", "server"))
    assert stat.S_IMODE(etcd.stat().st_mode) == 0o700


def test_only_an_authorised_key_gets_an_answer(tmp_path: Path, keys: Path) -> None:
    cluster = Cluster(tmp_path, {"ELASTIC_KEYS": str(keys)})
    try:
        cluster.start_services()
        other = tmp_path / "other-keys"
        generate_keys(other)
        unauthorised = tmp_path / "unauthorised"
        generate_keys(unauthorised)
        shutil.copy(keys / "server.key", unauthorised / "server.key")
        for service in SERVICES:
            endpoint = getattr(cluster.endpoints, service)
            for security in (Security(), Security(keys_dir=other), Security(keys_dir=unauthorised)):
                client = Client(endpoint, "intruder", security=security, timeout=0.5, deadline=0.5)
                with pytest.raises(Unreachable):
                    client.request("ping")
                client.close()
            good = Client(endpoint, "friend", security=Security(keys_dir=keys), timeout=1.0, deadline=2.0)
            assert good.request("ping").body == {"service": service}
            good.close()
        assert "client_refused" in cluster.output("registry")
        for service in SERVICES:
            assert cluster.stop(service, timeout=5) == 0, f"{service} stops cleanly on SIGTERM with its authenticator"
    finally:
        cluster.close()


def test_services_refuse_a_public_bind_without_keys(tmp_path: Path) -> None:
    env = {**os.environ, "ELASTIC_BIND": "0.0.0.0", "ELASTIC_RUN_DIR": str(tmp_path)}  # its state, if any, here
    env.pop("ELASTIC_KEYS", None)
    env.pop("ELASTIC_STATE_DIR", None)
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.services.registry"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "refusing to bind tcp://0.0.0.0" in result.stderr and "Traceback" not in result.stderr


def test_a_job_survives_kill_9_with_curve_on_and_the_ipc_socket_is_owner_only(tmp_path: Path, keys: Path) -> None:
    cluster = Cluster(tmp_path, {"ELASTIC_KEYS": str(keys)})
    try:
        cluster.start_services()
        cluster.start_agent("host-1", 2)
        cluster.start_agent("host-2", 2)
        socket_path = cluster.workdir / "run" / "agent-host-1.sock"
        assert stat.S_IMODE(socket_path.stat().st_mode) & 0o077 == 0
        assert stat.S_IMODE(socket_path.parent.stat().st_mode) & 0o077 == 0
        log_dir = tmp_path / "train"
        job = cluster.submit(
            "--min-np", "2", "--", *JOB, "--epochs", "3", "--step-delay", "0.02", "--log-dir", str(log_dir)
        )
        wait_for_size(log_dir, 4)
        running = [w for w in cluster.status()["workers"] if w["state"] == "RUNNING" and w["pid"]]
        assert running, "no worker running to look at"
        for worker in running:
            assert "ELASTIC_KEYS" not in environment_of(worker["pid"]), f"{worker} was given the keys"
        assert environment_of(cluster.processes["agent-host-1"].pid)["ELASTIC_KEYS"] == str(keys), "its agent has them"
        victim = worker_pid(cluster, "host-2", 1)
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: any(
                e["host"] == "host-2" and e["pid"] != victim and e["size"] == 4 and e["time"] > killed_at
                for e in steps(log_dir)
            ),
            60,
            "host-2's slot 1 training again in a new process",
        )
        assert cluster.wait_job_end(job, 180) == 0
        assert_training_invariants(log_dir)
        wait_for(lambda: not cluster.leftover_workers(), 10, "workers gone")
    finally:
        cluster.close()


def environment_of(pid: int) -> dict[str, str]:
    """A process's environment as the kernel keeps it from its exec: a forked worker's is its fork server's."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode(errors="replace").split("=", 1) for entry in raw if b"=" in entry)
