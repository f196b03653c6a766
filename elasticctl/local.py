"""`elasticctl local`: the whole system on this machine: four services and N agents on loopback, then the job.

Services log to files in a run directory; agents show warnings and the
workers' output on this terminal. On a machine with GPUs each agent gets GPUs
of its own (its `CUDA_VISIBLE_DEVICES`), unless `--share-gpus` lets workers
share them. Everything started here is stopped on the way out, whatever
happens; and if this process is killed outright (SIGKILL), the kernel kills
the services and agents it started (PR_SET_PDEATHSIG), and the agents' workers
die with their agents, so nothing is left holding the ports.

A service that dies while the job runs is started again at once, as
`restart: unless-stopped` does under docker compose (the registry's state is
in the run directory): the job rides through it. An agent that dies is not:
that is a host lost, and the job goes on without it.

With `--control-hosts N` (N > 1) the control plane is replicated, as on N
machines: control host i is the address 127.0.0.i, with one etcd member
(ETCD_CLIENT_PORT and ETCD_PEER_PORT, its data directory in the run
directory, removed with it at the end) and one replica of each service on the default ports of that
address (`--store etcd://...`, replication/replica.py). Nothing is started
again when it dies: the other replicas are the redundancy.

Private to its user: the services and agents require the run's own keys
(elasticctl/local_keys.py), the etcd members of `--control-hosts` a
certificate made for the run beside them (mutual TLS:
replication/etcd_tls.py), and the agents' sockets are in the user's own
0700 run directory (ELASTIC_RUN_DIR, checked), so no other user of the
machine can call them.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from elastic_control_plane.agent.gpus import check_standby, default_slots, gpu_devices
from elastic_control_plane.bus.config import Endpoints, endpoint_list
from elastic_control_plane.elasticctl.control import CommandError, ControlPlane
from elastic_control_plane.elasticctl.control_host import etcd_members, replica_commands, store_url, wait_for_etcd
from elastic_control_plane.elasticctl.follow import submit_and_follow
from elastic_control_plane.elasticctl.local_keys import live_local_keys, make_local_keys, remove_local_keys
from elastic_control_plane.elasticctl.local_processes import (
    SERVICES,
    Processes,
    StartFailed,
    agent_argv,
    registered,
    service_argv,
)
from elastic_control_plane.replication.etcd_member import MemberSpec, member_command
from elastic_control_plane.replication.etcd_tls import make_etcd_certs

START_TIMEOUT = 30.0
AGENT_DRAIN_GRACE = 5.0  # at the end, how long agents may wait for their workers' next commit before stopping them
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380


def control_addresses(count: int) -> list[str]:
    """The loopback addresses of `count` control hosts: 127.0.0.1, 127.0.0.2, ..."""
    return [f"127.0.0.{i}" for i in range(1, count + 1)]


def local_etcd_members(addresses: list[str], run_dir: Path, keys: Path) -> list[MemberSpec]:
    """The control hosts' etcd members, over mutual TLS with certificates made for this run beside its keys."""
    tls = make_etcd_certs(keys, ["localhost", *addresses])
    return etcd_members([(host, ETCD_CLIENT_PORT, ETCD_PEER_PORT) for host in addresses], run_dir, tls)


def agent_devices(devices: list[str], hosts: int, slots: int, share_gpus: bool) -> list[str | None]:
    """Each agent's CUDA_VISIBLE_DEVICES: GPUs of its own, so workers of two agents never meet on one GPU;
    None (the machine's setting) without GPUs or when workers share them."""
    if not devices or share_gpus:
        return [None] * hosts
    if hosts * slots > len(devices):
        raise CommandError(
            f"--hosts {hosts} x --slots {slots} needs {hosts * slots} GPUs, this machine has {len(devices)}; "
            "lower --hosts or --slots, or pass --share-gpus",
            2,
        )
    return [",".join(devices[i * slots : (i + 1) * slots]) for i in range(hosts)]


@dataclass
class LocalCluster:
    hosts: int
    slots: int
    endpoints: Endpoints
    log_dir: Path
    devices: list[str | None]
    keys: Path
    share_gpus: bool = False
    standby: int | None = None
    control_hosts: int = 1
    processes: Processes = field(default_factory=Processes)
    _stopping: threading.Event = field(default_factory=threading.Event)

    def _start(self, name: str, argv: list[str], env: dict[str, str], log_to_file: bool) -> None:
        self.processes.start(name, argv, env, self.log_dir / f"{name}.log" if log_to_file else None)

    def _start_etcd(self, members: list[MemberSpec]) -> None:
        for member in members:
            self._start(f"etcd@{member.host}", member_command(member, members), dict(os.environ), log_to_file=True)
        wait_for_etcd(members, self._wait)

    def start(self) -> None:
        env = {
            **os.environ,
            **self.endpoints.as_env(),
            "ELASTIC_STATE_DIR": str(self.log_dir / "state"),
            "ELASTIC_KEYS": str(self.keys),
        }
        if self.control_hosts > 1:
            addresses = control_addresses(self.control_hosts)
            members = local_etcd_members(addresses, self.log_dir, self.keys)
            self._start_etcd(members)
            env["ELASTIC_STORE"] = store_url(members)
            for host in addresses:
                for name, argv in replica_commands(host):
                    self._start(name, argv, env, True)
        else:
            for service in SERVICES:
                self._start(service, service_argv(service), env, log_to_file=True)
        plane = ControlPlane(self.endpoints, self.keys, timeout=0.5)
        try:
            for service in SERVICES:
                self._wait(lambda s=service: plane.call(s, "ping"), f"the {service} service to answer")
            agent_env = {**env, "ELASTIC_LOG_LEVEL": os.environ.get("ELASTIC_LOG_LEVEL", "WARNING")}
            share = ["--share-gpus"] if self.share_gpus else []
            share += ["--standby", str(self.standby)] if self.standby is not None else []
            for i, devices in enumerate(self.devices, start=1):
                own_gpus = {} if devices is None else {"CUDA_VISIBLE_DEVICES": devices}
                host = f"host-{i}"
                self._start(f"agent {host}", agent_argv(host, self.slots, *share), {**agent_env, **own_gpus}, False)
                self._wait(lambda h=host: registered(plane.call("discovery", "hosts"), h), f"agent {host} to register")
        finally:
            plane.close()
        if self.control_hosts > 1:
            return  # the replicas are the redundancy: nothing is started again
        threading.Thread(target=self._supervise, args=(env,), name="supervise-services", daemon=True).start()

    def _supervise(self, env: dict[str, str]) -> None:
        """Start again, once a second at most each, the services that died (not the agents: a dead agent is a lost
        host)."""
        while not self._stopping.wait(1.0):
            with self.processes.lock:  # stop() takes it after setting _stopping: nothing starts once it has the list
                if self._stopping.is_set():
                    return
                for name, process in list(self.processes.running.items()):
                    if name in SERVICES and process.poll() is not None:
                        click.echo(
                            f"[elasticctl] local: the {name} service exited with code {process.returncode}; "
                            "starting it again",
                            err=True,
                        )
                        self._start(name, service_argv(name), env, log_to_file=True)

    def _wait(self, probe: Any, what: str) -> None:
        """Wait for `probe` while every process started so far runs; a CommandError naming the logs when not."""
        try:
            self.processes.wait_until(probe, START_TIMEOUT, what, watched=list(self.processes.running))
        except StartFailed as exc:
            raise CommandError(f"{exc} (logs: {self.log_dir})") from None

    def stop(self) -> None:
        """Agents first (they drain, then stop their workers at once if a commit is not near), then services, then
        etcd; SIGKILL whatever lingers."""
        self._stopping.set()
        self.processes.drain_agents(grace=AGENT_DRAIN_GRACE)
        self.processes.stop_all(agents_with=signal.SIGTERM, grace=10.0)
        for data_dir in self.log_dir.glob("etcd-*"):  # the job is over; etcd preallocates 64 MiB of log per member
            shutil.rmtree(data_dir, ignore_errors=True)


def already_running(endpoints: Endpoints) -> bool:
    plane = ControlPlane(endpoints, live_local_keys(), timeout=0.3)
    try:
        plane.call("registry", "ping")
        return True
    except CommandError:
        return False
    finally:
        plane.close()


def _interrupted(*_: Any) -> None:
    raise KeyboardInterrupt


def run_local(
    hosts: int,
    slots: int | None,
    spec: dict[str, Any],
    share_gpus: bool = False,
    standby: int | None = None,
    control_hosts: int = 1,
) -> int:
    gpus = gpu_devices()
    slots = default_slots(len(gpus), hosts) if slots is None else slots
    try:
        if standby is not None:
            check_standby(standby, slots)
    except ValueError as exc:
        raise CommandError(str(exc), 2) from None
    devices = agent_devices(gpus, hosts, slots, share_gpus)
    endpoints = Endpoints.on_hosts(control_addresses(control_hosts)) if control_hosts > 1 else Endpoints.from_env()
    if control_hosts == 1 and any(len(endpoint_list(value)) > 1 for value in endpoints.values()):
        raise CommandError(
            "elasticctl local runs its own control plane on this machine: ELASTIC_CONTROL (or ELASTIC_*_ENDPOINT) "
            "names several hosts (for a replicated one here, use --control-hosts N)",
            2,
        )
    if already_running(endpoints):
        raise CommandError(
            f"a control plane already answers at {endpoints.registry} (another elasticctl local or docker "
            "compose?); stop it first"
        )
    keys = make_local_keys()
    log_dir = Path(tempfile.mkdtemp(prefix="elastic-local-"))
    cluster = LocalCluster(hosts, slots, endpoints, log_dir, devices, keys, share_gpus, standby, control_hosts)
    shown = f", {len(gpus)} GPU(s){' shared' if share_gpus else ''}" if gpus else ""
    shown += f", {control_hosts} control hosts (127.0.0.1-{control_hosts}, etcd)" if control_hosts > 1 else ""
    click.echo(f"[elasticctl] local: {hosts} host(s) x {slots} slot(s){shown}; service logs in {log_dir}", err=True)
    previous = signal.signal(signal.SIGTERM, _interrupted)
    try:
        cluster.start()
        plane = ControlPlane(endpoints, keys)
        try:
            return submit_and_follow(plane, spec)
        finally:
            plane.close()
    finally:
        cluster.stop()
        remove_local_keys(keys)
        signal.signal(signal.SIGTERM, previous)
