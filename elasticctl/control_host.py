"""What one control host of a replicated control plane runs: one etcd member (mutual TLS) and one replica of each
service (`--store etcd://...`, `--bind` its address; replication/replica.py). `elasticctl local --control-hosts N`
starts them on 127.0.0.i (elasticctl/local.py), `elasticctl slurm --control-hosts N` on the allocation's first N
nodes, one Slurm step each (slurm/control_steps.py): both build the members, the store URL and the replicas' command
lines here, and wait for etcd the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from elastic_control_plane.elasticctl.local_processes import SERVICES, service_argv
from elastic_control_plane.replication.etcd import EtcdClient, EtcdError
from elastic_control_plane.replication.etcd_member import MemberSpec
from elastic_control_plane.replication.etcd_tls import EtcdTls


def etcd_members(hosts: list[tuple[str, int, int]], data_dir: Path, tls: EtcdTls) -> list[MemberSpec]:
    """The members of the control hosts `hosts` ((address, client port, peer port) each), over mutual TLS; member i
    (from 1) keeps its data in `data_dir`/etcd-i."""
    return [
        MemberSpec(f"control-{i}", host, client, peer, data_dir / f"etcd-{i}", tls)
        for i, (host, client, peer) in enumerate(hosts, start=1)
    ]


def store_url(members: list[MemberSpec]) -> str:
    """The services' `--store`: every member's client address."""
    return "etcd://" + ",".join(f"{m.host}:{m.client_port}" for m in members)


def wait_for_etcd(members: list[MemberSpec], wait: Callable[[Callable[[], bool], str], Any]) -> None:
    """`wait` (a probe, what it waits for) until the members answer a linearizable read: they have elected a leader."""
    tls = None if members[0].tls is None else members[0].tls.client_context()
    client = EtcdClient([f"{m.host}:{m.client_port}" for m in members], deadline=1.0, tls=tls)

    def answers() -> bool:
        try:
            client.get(b"elastic/schema")
            return True
        except EtcdError:
            return False

    try:
        wait(answers, "etcd to elect a leader")
    finally:
        client.close()


def replica_commands(host: str, name: str | None = None) -> list[tuple[str, list[str]]]:
    """(process name `SERVICE@NAME`, command line) of each service's replica binding `host` (NAME: `host`)."""
    return [(f"{service}@{name or host}", service_argv(service, "--bind", host)) for service in SERVICES]
