"""Where etcd's leader should move: to the member whose host has the fewest active replicas, if fewer than its own."""

from __future__ import annotations

from collections import Counter

from elastic_control_plane.replication.etcd_wire import Member
from elastic_control_plane.replication.leader_placement import leader_target, url_host

MEMBERS = [
    Member(id=0x30, name="c1", peer_urls=[], client_urls=["http://127.0.0.1:2379"]),
    Member(id=0x10, name="c2", peer_urls=[], client_urls=["http://127.0.0.2:2379"]),
    Member(id=0x20, name="c3", peer_urls=[], client_urls=["http://127.0.0.3:2379"]),
]


def test_a_leader_on_an_active_replicas_host_moves_to_the_free_member_with_the_lowest_id() -> None:
    assert leader_target(MEMBERS, 0x30, Counter({"127.0.0.1": 1})) == 0x10
    assert leader_target(MEMBERS, 0x30, Counter({"127.0.0.1": 3, "127.0.0.2": 1})) == 0x20


def test_with_an_active_replica_on_every_host_the_leader_moves_to_the_host_with_the_fewest() -> None:
    assert leader_target(MEMBERS, 0x30, Counter({"127.0.0.1": 2, "127.0.0.2": 1, "127.0.0.3": 1})) == 0x10


def test_a_leader_on_a_host_with_no_active_replica_stays() -> None:
    assert leader_target(MEMBERS, 0x30, Counter({"127.0.0.2": 2, "127.0.0.3": 2})) is None
    assert leader_target(MEMBERS, 0x30, Counter()) is None


def test_with_as_many_active_replicas_on_every_members_host_there_is_no_better_place() -> None:
    assert leader_target(MEMBERS, 0x30, Counter({"127.0.0.1": 1, "127.0.0.2": 1, "127.0.0.3": 1})) is None


def test_members_in_pods_of_their_own_share_no_host_with_a_replica_and_nothing_moves() -> None:
    pods = [
        Member(id=n, name=f"etcd-{n}", peer_urls=[], client_urls=[f"https://etcd-{n}.etcd:2379"]) for n in (1, 2, 3)
    ]
    assert leader_target(pods, 1, Counter({"10.0.0.7": 2, "10.0.0.8": 2})) is None


def test_an_unknown_leader_or_a_member_not_started_yet_is_left_alone() -> None:
    assert leader_target(MEMBERS, 0x99, Counter({"127.0.0.1": 1})) is None
    unstarted = [*MEMBERS[:2], Member(id=0x05, name="", peer_urls=["http://127.0.0.3:2380"], client_urls=[])]
    assert leader_target(unstarted, 0x30, Counter({"127.0.0.1": 1, "127.0.0.2": 1})) is None


def test_url_hosts() -> None:
    assert url_host("http://127.0.0.2:2379") == "127.0.0.2"
    assert url_host("https://[::1]:2379") == "::1"
    assert url_host("etcd-0.etcd:2379") == "etcd-0.etcd"
