"""EtcdCluster: a real three-member etcd cluster on loopback addresses, for the tests of the replicated control plane.

Each member listens on its own address (127.0.0.1, .2, .3) with the same
client port and peer port, so that a member's endpoints say which it is. The
ports lie below the kernel's ephemeral range: a killed member's port is not
given to an outgoing connection before it restarts. Members are started as
replication/etcd_member.py says (a leader elected within a second) and die
with the process that started them; `stop()` kills them and removes their
data. Each member logs to `<base_dir>/<name>.log`, kept for `dump_logs()`.
With `tls=True` the members require mutual TLS (replication/etcd_tls.py), with
certificates made in `<base_dir>/keys/etcd/`; `client()` speaks it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any

from elastic_control_plane.bus.lifetime import die_with_parent
from elastic_control_plane.replication.election import ElectionTiming, Leadership
from elastic_control_plane.replication.etcd import EtcdClient
from elastic_control_plane.replication.etcd_member import QUOTA_BACKEND_BYTES, MemberSpec, member_command
from elastic_control_plane.replication.etcd_tls import make_etcd_certs
from testing.harness import free_ports, wait_for

HEALTHY_WITHIN = 30.0  # seconds for members to start and elect a leader, on a loaded machine


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def _free_port_pair(hosts: tuple[str, ...]) -> tuple[int, int]:
    while True:
        client_port, peer_port = free_ports(2)
        if all(_bindable(host, port) for host in hosts for port in (client_port, peer_port)):
            return client_port, peer_port


class EtcdCluster:
    def __init__(
        self,
        base_dir: Path,
        hosts: tuple[str, ...] = ("127.0.0.1", "127.0.0.2", "127.0.0.3"),
        quota_bytes: int = QUOTA_BACKEND_BYTES,
        tls: bool = False,
    ) -> None:
        self.base_dir = base_dir
        self.quota_bytes = quota_bytes
        base_dir.mkdir(parents=True, exist_ok=True)
        self.keys_dir = base_dir / "keys"
        self.tls = make_etcd_certs(self.keys_dir, ("localhost", *hosts)) if tls else None
        client_port, peer_port = _free_port_pair(hosts)
        self.members = [
            MemberSpec(f"etcd{i}", host, client_port, peer_port, base_dir / f"etcd{i}.data", self.tls)
            for i, host in enumerate(hosts)
        ]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * len(hosts)
        self._states = ["new"] * len(hosts)  # "existing" for a member that replaced a removed one
        self._status = self.client()

    def client(self, endpoints: list[str] | None = None, **options: Any) -> EtcdClient:
        """A client of the members (or of `endpoints`), speaking TLS where the members require it."""
        tls = None if self.tls is None else self.tls.client_context()
        return EtcdClient(self.client_endpoints if endpoints is None else endpoints, tls=tls, **options)

    @property
    def client_endpoints(self) -> list[str]:
        return [f"{member.host}:{member.client_port}" for member in self.members]

    @property
    def store_url(self) -> str:
        return "etcd://" + ",".join(self.client_endpoints)

    def log_path(self, index: int) -> Path:
        return self.base_dir / f"{self.members[index].name}.log"

    def running(self, index: int) -> bool:
        process = self.processes[index]
        return process is not None and process.poll() is None

    def start(self) -> None:
        """Starts every member that is not running (all of them at first, or those killed) and waits until each
        answers and they agree on a leader."""
        for index in range(len(self.members)):
            if not self.running(index):
                self._spawn(index)
        self.wait_healthy()

    def _spawn(self, index: int) -> None:
        command = member_command(
            self.members[index], self.members, state=self._states[index], quota_bytes=self.quota_bytes
        )
        with open(self.log_path(index), "ab") as log:
            self.processes[index] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent()
            )

    def wait_healthy(self) -> None:
        """Waits until every running member answers and all of them name the same leader, one of them."""

        def agreed() -> bool:
            statuses = [self._status.endpoint_status(self.client_endpoints[i]) for i in self._running_indexes()]
            if not statuses or any(status is None for status in statuses):
                return False
            leaders = {status["leader"] for status in statuses}
            return len(leaders) == 1 and leaders <= {status["member_id"] for status in statuses}

        wait_for(agreed, HEALTHY_WITHIN, "the etcd members to answer and agree on a leader", interval=0.1)

    def _running_indexes(self) -> list[int]:
        return [index for index in range(len(self.members)) if self.running(index)]

    def leader_index(self) -> int:
        """The index of the member that leads now (waits for an election that is under way)."""

        def leader() -> int | None:
            statuses = {i: self._status.endpoint_status(self.client_endpoints[i]) for i in self._running_indexes()}
            for index, status in statuses.items():
                if status is not None and status["leader"] == status["member_id"]:
                    return index + 1  # wait_for wants something truthy: index 0 is a leader too
            return None

        return wait_for(leader, HEALTHY_WITHIN, "an etcd leader", interval=0.1) - 1

    def kill(self, index: int) -> None:
        """SIGKILLs member `index` (its data stays)."""
        process = self.processes[index]
        if process is not None:
            process.kill()
            process.wait()

    def restart(self, index: int) -> None:
        """Starts member `index` again on its data directory and waits until the cluster is healthy."""
        self.kill(index)
        self._spawn(index)
        self.wait_healthy()

    def replace(self, index: int) -> None:
        """Member `index` as if its disk were lost: killed, its data deleted, removed from the cluster and added
        back as a new member (a new member id) that starts empty and catches up from the others."""
        spec = self.members[index]
        self.kill(index)
        shutil.rmtree(spec.data_dir, ignore_errors=True)
        others = self.client([self.client_endpoints[i] for i in self._running_indexes()], deadline=HEALTHY_WITHIN)
        try:
            for member in others.members():
                if member.name == spec.name or spec.peer_url in member.peer_urls:
                    others.member_remove(member.id)
            others.member_add([spec.peer_url])
        finally:
            others.close()
        self._states[index] = "existing"
        self._spawn(index)
        self.wait_healthy()

    def stop(self) -> None:
        """Kills every member and removes their data; the logs stay. Safe to call twice."""
        for index in range(len(self.members)):
            self.kill(index)
        for member in self.members:
            shutil.rmtree(member.data_dir, ignore_errors=True)
        self._status.close()

    def dump_logs(self) -> str:
        """The last 40 lines of each member's log."""
        parts = []
        for index, member in enumerate(self.members):
            path = self.log_path(index)
            lines = path.read_text(errors="replace").splitlines() if path.exists() else []
            parts.append(f"----- {member.name} {member.client_url} (last 40 lines) -----\n" + "\n".join(lines[-40:]))
        return "\n".join(parts)


def active_role(client: EtcdClient, prefix: str, log: Any, replica: str = "a") -> Leadership:
    """A registry replica under `prefix` that registered and won the role (a 2 s lease), as a service's would."""
    role = Leadership(client, prefix, "registry", replica, f"tcp://{replica}:1", timing=ElectionTiming(2), log=log)
    never = threading.Event()
    assert role.register(never) and role.campaign(never)
    return role
