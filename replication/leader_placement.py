"""Keeping etcd's leader off the hosts of the services' active replicas.

A control host lost with etcd's leader on it costs more than one without: the
members elect a new leader, which extends every lease by its TTL plus one
election timeout when it takes over (etcd's lessor `Promote`), and checks for
expired leases every 500 ms; the standbys of the services that were active on
the lost host see their role free only 2 to 3 s after the loss, against 1 to
1.5 s when etcd's leader lives elsewhere (bench/control_plane_ha.py).

So each active replica looks, every PLACEMENT_EVERY seconds, at where etcd's
leader is (its members' status) and at the hosts of the services' active
replicas (the election keys' records). When another member's host has fewer
active replicas than the leader's, it asks the leader to hand its leadership
over to the member with the fewest (etcd's MoveLeader: a transfer, no
election timeout): a host lost then takes as few services' leases with it
as can be. A host is the host part of a member's client URLs and of a
replica's address: 127.0.0.i for `elasticctl local --control-hosts 3`; in a
cluster whose etcd members run in pods of their own no member shares a host
with a replica, and nothing moves. With as many active replicas on every
member's host there is no better place, and nothing moves either.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable, Iterable

import structlog

from elastic_control_plane.bus.config import endpoint_host
from elastic_control_plane.replication.election import leader_key
from elastic_control_plane.replication.etcd import EtcdClient, EtcdError
from elastic_control_plane.replication.etcd_wire import Member, split_endpoint

PLACEMENT_EVERY = 2.0
MOVE_TIMEOUT = 2.0


def url_host(url: str) -> str:
    """The host of a member's client URL (http://H:P or H:P), without IPv6 brackets."""
    return split_endpoint(url.partition("://")[2] or url)[0]


def leader_target(members: Iterable[Member], leader: int, actives: Counter[str]) -> int | None:
    """The member etcd's leader should move to, given the number of active replicas on each host: the member with the
    fewest on its host (then the lowest id), when that is fewer than on the leader's; None when the leader's host has
    none or no member does better."""
    hosts = {member.id: {url_host(url) for url in member.client_urls} for member in members if member.client_urls}
    if leader not in hosts:
        return None
    cost = {member: sum(actives[host] for host in its_hosts) for member, its_hosts in hosts.items()}
    best = min((member for member in cost if member != leader), key=lambda member: (cost[member], member), default=None)
    return best if best is not None and cost[best] < cost[leader] else None


class LeaderPlacement:
    """The loop of an active replica that moves etcd's leader off the active replicas' hosts (on a client of its own:
    it never delays the service's writes)."""

    def __init__(
        self, client: EtcdClient, prefix: str, active: Callable[[], bool], log: structlog.stdlib.BoundLogger
    ) -> None:
        self.client, self.prefix, self.active, self.log = client.sibling(), prefix, active, log

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self._run, args=(stop,), name="etcd-leader-placement", daemon=True)
        thread.start()
        return thread

    def _run(self, stop: threading.Event) -> None:
        try:
            while not stop.wait(PLACEMENT_EVERY):
                if self.active():
                    try:
                        self.place()
                    except EtcdError as exc:
                        self.log.debug("etcd_leader_not_placed", reason=str(exc))
        finally:
            self.client.close()

    def actives(self) -> Counter[str]:
        """The number of services whose active replica is on each host, from the records of the election keys."""
        records, _ = self.client.get_prefix(leader_key(self.prefix, ""))
        hosts: Counter[str] = Counter()
        for record in records:
            try:
                address = json.loads(record.value).get("address", "")
            except (ValueError, AttributeError):
                continue
            host = endpoint_host(address) if isinstance(address, str) else None
            if host:
                hosts[host] += 1
        return hosts

    def place(self) -> int | None:
        """Move etcd's leader to the member with the fewest active replicas on its host, if it has fewer than the
        leader's: the member it was moved to, or None."""
        statuses = {endpoint: self.client.endpoint_status(endpoint) for endpoint in self.client.endpoints}
        leaders = {status["leader"] for status in statuses.values() if status and status["leader"]}
        if len(leaders) != 1:
            return None  # an election under way, or no member answers: look again later
        leader = leaders.pop()
        target = leader_target(self.client.members(), leader, self.actives())
        on_leader = [endpoint for endpoint, status in statuses.items() if status and status["member_id"] == leader]
        if target is None or not on_leader:
            return None
        self.client.call_member(
            on_leader[0], "/v3/maintenance/transfer-leadership", {"targetID": str(target)}, MOVE_TIMEOUT
        )
        self.log.info("etcd_leader_moved", member=f"{leader:x}", to=f"{target:x}")
        return target
