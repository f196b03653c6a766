"""A replicated control plane for tests and benchmarks: a real 3-member etcd and one replica of each service on each
control host (127.0.0.1, 127.0.0.2, 127.0.0.3), the agents and clients given every control host.

`ReplicatedCluster` is a `Cluster` (testing/harness.py) whose services run with
`--store etcd://...` and `--bind <control host>`; a replica's process is named
`SERVICE@HOST`. It can lose a whole control host (SIGKILL of its replicas
and its etcd member, the member's data directory deleted), replace it (a new
member with an empty data directory, new replicas that start as standbys),
and tell which replica of a service is active (its election key in etcd).
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

from elastic_control_plane.bus.config import Endpoints
from elastic_control_plane.elasticctl.local_processes import service_argv
from elastic_control_plane.replication.election import leader_key
from testing.etcd_cluster import EtcdCluster
from testing.harness import SERVICES, Cluster, wait_for

PREFIX = "elastic"


def replica_name(service: str, host: str) -> str:
    return f"{service}@{host}"


class ReplicatedCluster(Cluster):
    def __init__(self, workdir: Path, etcd: EtcdCluster, extra_env: dict[str, str] | None = None) -> None:
        super().__init__(workdir, extra_env)
        self.etcd = etcd
        self.control_hosts = [member.host for member in etcd.members]
        ports = [endpoint.rpartition(":")[2] for endpoint in self.endpoints.values()]
        self.endpoints = Endpoints(*(",".join(f"tcp://{host}:{port}" for host in self.control_hosts) for port in ports))
        self.env.update(self.endpoints.as_env())
        self.env["ELASTIC_STORE"] = etcd.store_url
        self._etcd_client = etcd.client()

    def start_replicas(self, host: str, services: tuple[str, ...] = SERVICES) -> None:
        for service in services:
            self.spawn(
                replica_name(service, host),
                service_argv(service, "--bind", host),
            )

    def start_services(
        self, extra_args: dict[str, list[str]] | None = None, services: tuple[str, ...] = SERVICES
    ) -> None:
        """Every replica of `services` on every control host; returns once each service answers (one is active)."""
        for host in self.control_hosts:
            self.start_replicas(host, services)
        for service in services:
            wait_for(lambda s=service: self.call(s, "ping", timeout=0.5), 30, f"an active {service} to answer")

    def active(self, service: str) -> str | None:
        """The control host whose replica of `service` holds the role, by its election key; None while none does."""
        holder = self._etcd_client.get(leader_key(PREFIX, service))
        return None if holder is None else str(json.loads(holder.value)["replica"])

    def actives(self) -> dict[str, str | None]:
        return {service: self.active(service) for service in SERVICES}

    def kill_control_host(self, host: str) -> None:
        """Lose `host` outright: SIGKILL its replicas and its etcd member, and delete the member's data directory."""
        for service in SERVICES:
            process = self.processes.get(replica_name(service, host))
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.wait(timeout=10)
        index = self.control_hosts.index(host)
        self.etcd.kill(index)
        shutil.rmtree(self.etcd.members[index].data_dir, ignore_errors=True)

    def replace_control_host(self, host: str) -> None:
        """A new machine in the lost one's place: an etcd member with an empty data directory joins, and a replica of
        each service starts there as a standby."""
        self.etcd.replace(self.control_hosts.index(host))
        self.start_replicas(host)

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._etcd_client.close()
