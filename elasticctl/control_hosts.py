"""The control hosts of a replicated control plane, for `elasticctl status`: each host's etcd member (healthy, leader,
its database's size) and each service's replica on it (pid, active or standby), read from etcd (`--store` /
ELASTIC_STORE). elasticctl/status.py renders them."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from elastic_control_plane.replication.election import leader_key
from elastic_control_plane.replication.etcd import EtcdError
from elastic_control_plane.replication.replica import corrupt_key
from elastic_control_plane.replication.store_choice import StoreChoice

SERVICES = ("notifier", "discovery", "rendezvous", "registry")


def gather_control_hosts(choice: StoreChoice) -> list[dict[str, Any]]:
    """One row per control host: `{host, etcd: {member, client_url, healthy, leader, db_size, db_size_in_use} | None,
    replicas: {service: {pid, role}}}`; etcd out of reach gives one row per endpoint, each with `etcd.healthy`
    false."""
    client = choice.client(deadline=2.0)
    try:
        try:
            members = client.members()
        except EtcdError as exc:
            return [
                {"host": ep.rpartition(":")[0], "etcd": {"healthy": False, "error": str(exc)}, "replicas": {}}
                for ep in choice.endpoints
            ]
        hosts: dict[str, dict[str, Any]] = {}
        leader = None
        for member in members:
            url = member.client_urls[0] if member.client_urls else ""
            status = client.endpoint_status(urlsplit(url).netloc) if url else None
            leader = leader or (status or {}).get("leader")
            host = urlsplit(url).hostname or member.name or str(member.id)
            hosts[host] = {
                "host": host,
                "etcd": {
                    "member": member.name,
                    "id": member.id,
                    "client_url": url,
                    "healthy": status is not None,
                    "db_size": (status or {}).get("db_size"),
                    "db_size_in_use": (status or {}).get("db_size_in_use"),
                },
                "replicas": {},
            }
        for row in hosts.values():
            row["etcd"]["leader"] = row["etcd"]["id"] == leader
        for service in SERVICES:
            holder = client.get(leader_key(choice.prefix, service))
            active = json.loads(holder.value)["replica"] if holder is not None else None
            records, _ = client.get_prefix(f"{choice.prefix}/replicas/{service}/".encode())
            for kv in records:
                record = json.loads(kv.value)
                row = hosts.setdefault(record["replica"], {"host": record["replica"], "etcd": None, "replicas": {}})
                role = "active" if record["replica"] == active else "standby"
                row["replicas"][service] = {"pid": record["pid"], "role": role}
        return sorted(hosts.values(), key=lambda row: row["host"])
    finally:
        client.close()


def gather_corrupt_records(choice: StoreChoice) -> list[dict[str, str]]:
    """The records that keep a service from starting, as its replicas marked them (replication/replica.py):
    `{service, key, reason, replica}` each; none when etcd is out of reach (the control hosts say so)."""
    client = choice.client(deadline=2.0)
    try:
        marks, _ = client.get_prefix(corrupt_key(choice.prefix, ""))
    except EtcdError:
        return []
    finally:
        client.close()
    return [{"service": kv.key.decode().rpartition("/")[2], **json.loads(kv.value)} for kv in marks]
