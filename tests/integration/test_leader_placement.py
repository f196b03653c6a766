"""etcd's leader kept off the hosts of the active replicas, on a real three-member etcd (127.0.0.1-3).

The guilty case: the leader shares its host with an active replica and moves to the member whose host has none.
The innocent ones: a leader on a host with no active replica, and a leader with as many active replicas on every host,
stay where they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from elastic_control_plane.replication.election import leader_key
from elastic_control_plane.replication.etcd import EtcdClient
from elastic_control_plane.replication.leader_placement import LeaderPlacement
from testing.etcd_cluster import EtcdCluster
from testing.harness import wait_for

PREFIX = "/placement"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(Path(tmp_path_factory.mktemp("etcd")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def client(etcd: EtcdCluster) -> Iterator[EtcdClient]:
    instance = etcd.client(deadline=10.0)
    try:
        yield instance
    finally:
        instance.delete(f"{PREFIX}/".encode(), prefix=True)
        instance.close()


def activate(client: EtcdClient, etcd: EtcdCluster, services: dict[str, int]) -> None:
    """Record each service's active replica as etcd's election keys hold them, on member `index`'s host."""
    for service, index in services.items():
        address = f"tcp://{etcd.members[index].host}:5550"
        client.put(leader_key(PREFIX, service), json.dumps({"replica": service, "address": address}).encode())


def placement(client: EtcdClient) -> LeaderPlacement:
    return LeaderPlacement(client, PREFIX, lambda: True, structlog.get_logger())


def test_a_leader_sharing_a_host_with_an_active_replica_moves_to_a_member_whose_host_has_none(
    etcd: EtcdCluster, client: EtcdClient
) -> None:
    leader = etcd.leader_index()
    free = [index for index in range(3) if index != leader]
    activate(client, etcd, {"registry": leader, "discovery": free[0]})
    moved_to = placement(client).place()
    assert moved_to is not None
    wait_for(lambda: etcd.leader_index() == free[1], 30, f"etcd's leader to move to member {free[1]}")
    assert placement(client).place() is None  # placed: nothing moves again


def test_a_leader_on_a_host_with_no_active_replica_stays(etcd: EtcdCluster, client: EtcdClient) -> None:
    leader = etcd.leader_index()
    activate(client, etcd, {service: index for service, index in zip(("registry", "notifier"), {0, 1, 2} - {leader})})
    assert placement(client).place() is None
    assert etcd.leader_index() == leader


def test_with_an_active_replica_on_every_host_the_leader_stays(etcd: EtcdCluster, client: EtcdClient) -> None:
    leader = etcd.leader_index()
    activate(client, etcd, {"registry": 0, "discovery": 1, "notifier": 2})
    assert placement(client).place() is None
    assert etcd.leader_index() == leader
