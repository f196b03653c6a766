"""docker-compose.replicated.yml without a Docker engine: parse it, then run its commands as local processes.

The file is checked for shape: three etcd members that name each other, two
replicas of each service, every replica given the store and both replicas of
every service. Then each etcd member's command runs with this machine's etcd
(member N on 127.0.0.N, free ports, a data directory of the test's own), and
each replica's command with the compose environment (replica a on 127.0.0.1,
b on 127.0.0.2, same free ports, the store's addresses rewritten): each
service answers through its list, one replica of each is active, and when the
active registry is SIGKILLed the other takes over.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from elastic_control_plane.bus.lifetime import die_with_parent
from elastic_control_plane.bus.sockets import generate_keys
from elastic_control_plane.replication.election import leader_key
from elastic_control_plane.replication.etcd_member import etcd_binary
from elastic_control_plane.replication.etcd_tls import ETCD_DIR, make_etcd_certs
from elastic_control_plane.replication.store_choice import StoreChoice
from testing.harness import free_ports, wait_for
from tests.integration.test_compose import (
    REPO,
    SERVICES,
    environment_of,
    local_argv,
    ping,
    published_ports,
    stop,
)

COMPOSE_FILE = REPO / "docker-compose.replicated.yml"
MEMBERS = ("etcd-1", "etcd-2", "etcd-3")
REPLICAS = {"a": "127.0.0.1", "b": "127.0.0.2"}
SERVICE_PORTS = {"discovery": 5550, "rendezvous": 5551, "registry": 5552, "notifier": 5553, "events": 5554}
ENDPOINT_VAR = {name: f"ELASTIC_{name.upper()}_ENDPOINT" for name in SERVICE_PORTS}


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    with COMPOSE_FILE.open() as f:
        return yaml.safe_load(f)


def test_three_members_that_name_each_other_and_two_replicas_of_each_service(compose: dict[str, Any]) -> None:
    services = compose["services"]
    replicas = {f"{name}-{replica}" for name in SERVICES for replica in REPLICAS}
    assert set(services) == set(MEMBERS) | replicas
    clusters = {next(a for a in services[m]["command"] if a.startswith("--initial-cluster=")) for m in MEMBERS}
    assert clusters == {"--initial-cluster=" + ",".join(f"{m}=https://{m}:2380" for m in MEMBERS)}
    for member in MEMBERS:
        flags = set(services[member]["command"])
        assert {"--client-cert-auth", "--peer-client-cert-auth", "--trusted-ca-file=/tls/ca.crt"} <= flags
        assert "./keys/etcd:/tls:ro" in services[member]["volumes"]
        assert not services[member].get("ports"), "etcd's client port stays on the compose network"
    for name in SERVICES:
        for replica in REPLICAS:
            service = services[f"{name}-{replica}"]
            assert service["hostname"] == f"{name}-{replica}"
            assert service["command"][:3] == ["python", "-m", f"elastic_control_plane.services.{name}"]
            env = environment_of(service)
            assert env["ELASTIC_KEYS"] == "/keys" and "ELASTIC_INSECURE" not in env
            assert service["volumes"] == ["./keys:/keys:ro"]
            assert env["ELASTIC_STORE"] == "etcd://" + ",".join(f"{m}:2379" for m in MEMBERS)
            for peer, port in SERVICE_PORTS.items():
                owner = "notifier" if peer == "events" else peer
                assert env[ENDPOINT_VAR[peer]] == f"tcp://{owner}-a:{port},tcp://{owner}-b:{port}"
    published = [p for name in replicas for p in map(str, services[name].get("ports", []))]
    host_ports = [entry.split(":")[0] for entry in published]
    assert len(host_ports) == len(set(host_ports)), f"two replicas publish one host port: {published}"
    assert published_ports(services["notifier-b"]) == {5553, 5554, 9553}


@pytest.fixture
def replicated_compose(compose: dict[str, Any], tmp_path: Path) -> Iterator[dict[str, Any]]:
    services = compose["services"]
    member_hosts = {m: f"127.0.0.{i}" for i, m in enumerate(MEMBERS, start=1)}
    client_port, peer_port, *service_ports = free_ports(2 + len(SERVICE_PORTS))
    ports = dict(zip(SERVICE_PORTS, service_ports))
    processes: dict[str, subprocess.Popen[bytes]] = {}
    # What the compose file's header has the operator make beside it (`elasticctl keys generate ./keys --etcd-host
    # ...`), for the members' addresses here; the containers' /keys and /tls are this directory and its etcd/.
    keys = tmp_path / "keys"
    generate_keys(keys)
    make_etcd_certs(keys, [*member_hosts.values(), *MEMBERS])

    def local(text: str, host: str | None = None) -> str:
        text = text.replace("/tls/", f"{keys / ETCD_DIR}/")
        if text.endswith(":2381"):  # a member's metrics: a free port of its own
            text = text.replace(":2381", f":{free_ports(1)[0]}")
        text = text.replace(":2379", f":{client_port}").replace(":2380", f":{peer_port}")
        for member, address in member_hosts.items():
            text = text.replace(f"//{member}:", f"//{address}:").replace(
                f"{member}:{client_port}", f"{address}:{client_port}"
            )
        return text.replace("0.0.0.0", host) if host else text

    try:
        for member, host in member_hosts.items():
            argv = [local(arg, host) for arg in services[member]["command"]]
            argv = [etcd_binary() if arg == "etcd" else arg for arg in argv]
            argv = [f"--data-dir={tmp_path / member}" if arg.startswith("--data-dir=") else arg for arg in argv]
            with open(tmp_path / f"{member}.log", "ab") as log:
                processes[member] = subprocess.Popen(
                    argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent()
                )
        store = local(environment_of(services["registry-a"])["ELASTIC_STORE"])
        endpoints = {
            ENDPOINT_VAR[name]: ",".join(f"tcp://{host}:{ports[name]}" for host in REPLICAS.values())
            for name in SERVICE_PORTS
        }
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
        for name in SERVICES:
            for replica, host in REPLICAS.items():
                compose_name = f"{name}-{replica}"
                env = {**environment_of(services[compose_name]), **endpoints, "ELASTIC_STORE": store}
                env["ELASTIC_KEYS"] = str(keys)
                env.update(ELASTIC_BIND=host, ELASTIC_REPLICA=services[compose_name]["hostname"], PYTHONPATH=str(REPO))
                metrics = free_ports(1)[0]
                argv = local_argv(services[compose_name]["command"])
                argv[argv.index("--metrics-port") + 1] = str(metrics)
                with open(tmp_path / f"{compose_name}.log", "ab") as log:
                    processes[compose_name] = subprocess.Popen(
                        argv,
                        env={**base_env, **env},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=REPO,
                        preexec_fn=die_with_parent(),
                    )
        yield {
            "processes": processes,
            "endpoints": endpoints,
            "etcd": [f"{host}:{client_port}" for host in member_hosts.values()],
            "logs": tmp_path,
            "keys": keys,
        }
    finally:
        # The replicas first, while etcd still answers their resignation; then the members.
        for _, process in sorted(processes.items(), key=lambda item: item[0] in MEMBERS):
            stop(process)


def registry_takes_over(
    etcd: list[str],
    processes: dict[str, subprocess.Popen[bytes]],
    replicas: tuple[str, str],
    endpoint: str,
    keys: Path,
) -> None:
    """SIGKILL the active one of the registry's two `replicas` (their names in etcd): the other takes over and
    answers through the registry's endpoint list. `keys`: the keys directory, with etcd's client certificate."""
    client = StoreChoice.parse("etcd", "etcd://" + ",".join(etcd)).with_keys(keys).client()
    try:

        def holder() -> str | None:
            found = client.get(leader_key("elastic", "registry"))
            return None if found is None else json.loads(found.value)["replica"]

        active = wait_for(holder, 30, "an active registry")
        assert active in replicas, active
        processes[active].send_signal(signal.SIGKILL)
        (other,) = set(replicas) - {active}
        wait_for(lambda: holder() == other, 30, f"{other} to take over")
        assert ping(endpoint, time.monotonic() + 30, keys)["service"] == "registry"
    finally:
        client.close()


def test_its_commands_run_one_active_replica_of_each_service_and_the_other_takes_over(
    replicated_compose: dict[str, Any],
) -> None:
    endpoints = replicated_compose["endpoints"]
    for name in SERVICES:
        answer = ping(endpoints[ENDPOINT_VAR[name]], time.monotonic() + 60, replicated_compose["keys"])
        assert answer["service"] == name
    registry_takes_over(
        replicated_compose["etcd"],
        replicated_compose["processes"],
        ("registry-a", "registry-b"),
        endpoints["ELASTIC_REGISTRY_ENDPOINT"],
        replicated_compose["keys"],
    )
