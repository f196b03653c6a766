"""Leadership: one active replica per service, chosen by a lease in etcd, and the fence on every write it makes.

A replica grants itself a lease (`ttl` seconds) and keeps it alive from a
thread. Under the lease it registers (`<prefix>/replicas/<service>/<replica>`:
its pid, address and since when), so `elasticctl status` sees standbys and
the active one alike, and a dead replica's record goes with its lease. It
campaigns by creating the election key `<prefix>/leader/<service>` under the
same lease in a txn that succeeds only while the key is absent; a replica
that lost waits on a watch of the key and tries again when it is deleted
(the holder's lease expired or was revoked). The winner's fence is the
election key's create revision: every write it makes is a txn comparing it
(`fence`), so a replica that lost the role can never write again, whatever
its clock thinks.

`held()` is the replica's own, conservative view: the lease counts from
before the keepalive that renewed it was sent, so the replica gives up the
role no later than etcd expires it. A replica that was paused (SIGSTOP, a
long GC, a partition) past its lease finds `held()` false as soon as it runs
again, before it handles anything.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog

from elastic_control_plane.replication.etcd import EtcdClient, EtcdError, create_revision_is, put_op

# Keepalives per lease: one every TTL/KEEPALIVES_PER_TTL; two may be lost before the lease is in danger.
KEEPALIVES_PER_TTL = 4


def leader_key(prefix: str, service: str) -> bytes:
    return f"{prefix}/leader/{service}".encode()


def replica_key(prefix: str, service: str, replica: str) -> bytes:
    return f"{prefix}/replicas/{service}/{replica}".encode()


class Outage:
    """Says once that etcd is out of reach (`etcd_unreachable`), and once that it answers again."""

    def __init__(self, log: structlog.stdlib.BoundLogger) -> None:
        self.log = log
        self.since: float | None = None

    def failed(self, exc: Exception) -> None:
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("etcd_unreachable", reason=str(exc))

    def ended(self) -> None:
        if self.since is not None:
            self.log.info("etcd_reachable", after_s=round(time.monotonic() - self.since, 3))
            self.since = None


class Leadership:
    """A replica's lease, its registration, its campaign for the role of `service`, and the fence of its writes."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        service: str,
        replica: str,
        address: str,
        *,
        ttl: int,
        clock: Callable[[], float] = time.monotonic,
        log: structlog.stdlib.BoundLogger | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.service = service
        self.replica = replica
        self.key = leader_key(prefix, service)
        self.ttl = ttl
        self.clock = clock
        self.log = log or structlog.get_logger().bind(process=service)
        self.record = {"replica": replica, "pid": os.getpid(), "address": address, "since": time.time()}
        self.lease = 0
        self.revision = 0  # the election key's create revision while this replica holds the role; 0 otherwise
        self.lost_reason = ""
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.outage = Outage(self.log)

    # -- the lease -----------------------------------------------------------------------------
    def register(self, stop: threading.Event) -> bool:
        """Grant the lease, record this replica under it and keep it alive from now on; while etcd is out of reach,
        try again (saying so once) until `stop` is set (False)."""
        while not stop.is_set():
            sent = self.clock()
            try:
                self.lease, granted = self.client.lease_grant(self.ttl)
                self._valid_until = sent + granted
                self.client.put(replica_key(self.prefix, self.service, self.replica), self._record(), lease=self.lease)
                break
            except EtcdError as exc:
                self.outage.failed(exc)
                stop.wait(0.2)
        else:
            return False
        self.outage.ended()
        self._keeper = threading.Thread(target=self._keep_alive, name="lease-keepalive", daemon=True)
        self._keeper.start()
        return True

    def _record(self, **extra: Any) -> bytes:
        return json.dumps({**self.record, **extra}, sort_keys=True).encode()

    def _keep_alive(self) -> None:
        interval = self.ttl / KEEPALIVES_PER_TTL
        while not self._stop.wait(interval):
            sent = self.clock()
            try:
                left = self.client.lease_keepalive(self.lease, deadline=max(0.1, self._valid_until - sent))
            except EtcdError as exc:
                if self.clock() >= self._valid_until:
                    self.lose(f"the lease could not be renewed: {exc}")
                    return
                continue
            if left <= 0:
                self.lose("the lease expired")
                return
            self._valid_until = sent + left

    def lose(self, reason: str) -> None:
        """Give up the lease and the role at once (the first reason is kept): it was not renewed in time, or a fenced
        write was refused (another replica holds the role)."""
        if not self.lost_reason:
            self.lost_reason = reason
        self._stop.set()

    def held(self) -> bool:
        """Whether this replica holds the lease by its own clock (and, once elected, the role)."""
        if self.lost_reason:
            return False
        if self.clock() >= self._valid_until:
            self.lose(f"the lease was not renewed for {self.ttl} s (paused or cut off from etcd)")
            return False
        return True

    # -- the role ------------------------------------------------------------------------------
    def campaign(self, stop: threading.Event) -> bool:
        """Wait until this replica holds the role (True) or `stop` is set or the lease is lost (False)."""
        while not stop.is_set() and self.held():
            try:
                won = self.client.txn(
                    [create_revision_is(self.key, 0)],
                    [put_op(self.key, self._record(), lease=self.lease)],
                    [],
                )
                self.outage.ended()
                if not won.succeeded:
                    holder = self.client.get(self.key)
                    if holder is None:
                        continue
                    if holder.lease != self.lease:
                        self._wait_for_deletion(holder.mod_revision + 1, stop)
                        continue
                    # A retried txn whose first attempt won: the key is this replica's.
                self.revision = won.revision if won.succeeded else holder.create_revision
                self.client.put(
                    replica_key(self.prefix, self.service, self.replica), self._record(active=True), lease=self.lease
                )
                return self.held()
            except EtcdError as exc:
                self.outage.failed(exc)
                stop.wait(0.2)
        return False

    def _wait_for_deletion(self, start_revision: int, stop: threading.Event) -> None:
        """Return once the election key is deleted, or `stop` is set, or this replica's lease is lost."""
        watching = threading.Event()

        def until_stopped() -> None:
            while not stop.is_set() and not self._stop.is_set() and not watching.is_set():
                stop.wait(0.2)
            watching.set()

        threading.Thread(target=until_stopped, daemon=True).start()
        try:
            for _, events in self.client.watch(self.key, start_revision=start_revision, stop=watching):
                if any(event.kind == "delete" for event in events):
                    return
        finally:
            watching.set()

    def fence(self) -> dict[str, Any]:
        """The compare every write of the active replica carries: the election key is still the one it created."""
        return create_revision_is(self.key, self.revision)

    def resign(self) -> None:
        """Stop renewing and revoke the lease: the role and the registration go at once, a standby takes over."""
        self._stop.set()
        if self.lease:
            try:
                self.client.lease_revoke(self.lease, deadline=1.0)
            except EtcdError as exc:
                self.log.warning("lease_not_revoked", reason=str(exc))

    def stop_renewing(self) -> None:
        self._stop.set()

    def write(self, ops: list[dict[str, Any]]) -> int:
        """Apply `ops` in one txn fenced by this replica's role; the revision it made. A refused fence gives the role
        up (`lose`) and raises `LostRole`; etcd out of reach past the lease raises `EtcdError`."""
        if not self.held():
            raise LostRole(f"{self.service}: this replica no longer holds the role ({self.lost_reason})")
        deadline = max(0.3, self._valid_until - self.clock())
        result = self.client.txn([self.fence()], ops, [], deadline=deadline)
        if not result.succeeded:
            self.lose("another replica holds the role: a write was refused")
            raise LostRole(f"{self.service}: another replica holds the role; this one stepped down")
        return result.revision


class LostRole(EtcdError):
    """A fenced write was refused: another replica was elected, and this one must not write again."""
