"""A real network partition: host-2's agent and workers live in a network namespace behind a veth pair.

Taking the link down makes host-2 a lost host (missed heartbeats): training
continues on host-1 and host-2 is blacklisted. When the link comes back, the
agent learns its host was declared lost, stops its stale workers, registers
again, and after the cooldown host-2 rejoins the job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_control_plane.elasticctl.local_processes import agent_argv
from testing.harness import HOST_LOST_AFTER, Cluster, wait_for
from tests.integration.training import JOB, assert_training_invariants, steps, wait_for_size

HOST_IP, NS_IP = "10.231.0.1", "10.231.0.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def namespace() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create a network namespace")
    tag = uuid.uuid4().hex[:6]
    names = {"ns": f"elastic-{tag}", "host_if": f"veh{tag}", "ns_if": f"ven{tag}"}
    try:
        _ip("netns", "add", names["ns"])
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.decode().strip()}")
    try:
        _ip("link", "add", names["host_if"], "type", "veth", "peer", "name", names["ns_if"])
        _ip("link", "set", names["ns_if"], "netns", names["ns"])
        _ip("addr", "add", f"{HOST_IP}/24", "dev", names["host_if"])
        _ip("link", "set", names["host_if"], "up")
        _ip("-n", names["ns"], "addr", "add", f"{NS_IP}/24", "dev", names["ns_if"])
        _ip("-n", names["ns"], "link", "set", names["ns_if"], "up")
        _ip("-n", names["ns"], "link", "set", "lo", "up")
        yield names
    finally:
        subprocess.run(["ip", "netns", "pids", names["ns"]], capture_output=True)
        subprocess.run(["ip", "link", "del", names["host_if"]], capture_output=True)
        subprocess.run(["ip", "netns", "del", names["ns"]], capture_output=True)


def test_a_partitioned_host_is_lost_then_rejoins_after_cooldown(tmp_path: Path, namespace: dict[str, str]) -> None:
    cluster = Cluster(tmp_path, {"ELASTIC_BIND": "0.0.0.0", "ELASTIC_INSECURE": "1", "ELASTIC_COLLECTIVE_TIMEOUT": "5"})
    try:
        cluster.start_services()
        cluster.env["GLOO_SOCKET_IFNAME"] = namespace["host_if"]
        cluster.start_agent("host-1", 2, ["--advertise-addr", HOST_IP])
        remote = {
            f"ELASTIC_{name.upper()}_ENDPOINT": value.replace("127.0.0.1", HOST_IP)
            for name, value in vars(cluster.endpoints).items()
        }
        ns_env = {**cluster.env, **remote, "GLOO_SOCKET_IFNAME": namespace["ns_if"]}
        cluster.spawn(
            "agent-host-2",
            [
                "ip",
                "netns",
                "exec",
                namespace["ns"],
                *agent_argv("host-2", 2, "--advertise-addr", NS_IP),
            ],
            env=ns_env,
        )
        wait_for(
            lambda: any(h["host"] == "host-2" for h in cluster.call("discovery", "hosts")["all"]),
            20,
            "host-2 to register from its namespace",
        )
        log_dir = tmp_path / "train"
        job = cluster.submit(
            "--min-np",
            "2",
            "--blacklist-cooldown",
            "3",
            "3",
            "--",
            *JOB,
            "--epochs",
            "6",
            "--step-delay",
            "0.03",
            "--log-dir",
            str(log_dir),
        )
        wait_for_size(log_dir, 4)

        _ip("link", "set", namespace["host_if"], "down")
        wait_for(
            lambda: next(h for h in cluster.status()["hosts"] if h["host"] == "host-2")["state"] == "lost",
            HOST_LOST_AFTER + 3.0,
            "host-2 lost",
        )
        cut_at = max(e["time"] for e in steps(log_dir))
        wait_for_size(log_dir, 2, after=cut_at, timeout=30)

        _ip("link", "set", namespace["host_if"], "up")
        healed_at = max(e["time"] for e in steps(log_dir))
        wait_for_size(log_dir, 4, after=healed_at, timeout=60)
        assert cluster.wait_job_end(job, 240) == 0, cluster.output("elasticctl-run")
        assert_training_invariants(log_dir)
    finally:
        cluster.close()
