"""Leadership: one active replica per service, chosen by a lease in etcd, and the fence on every write it makes.

A replica grants itself a lease (`ElectionTiming.lease_s` seconds) and keeps it alive from a
thread, on a client of its own (`EtcdClient.sibling`: a renewal never waits behind a service's
write). Under the lease it registers (`<prefix>/replicas/<service>/<replica>`: its pid,
address and since when), so `elasticctl status` sees standbys and the active one alike, and a
dead replica's record goes with its lease. It campaigns by creating the election key
`<prefix>/leader/<service>` under the same lease in a txn that succeeds only while the key is
absent; a replica that lost waits on a watch of the key and tries again when it is deleted (the
holder's lease expired or was revoked). It watches from the revision it read the key at, never
from the key's own revision, which etcd's compaction may have dropped from its history. The
winner's fence is the election key's create revision: every write it makes is a txn comparing it
(`fence`), so a replica that lost the role can never write again, whatever
its clock thinks. Its writes are also ordered: each rewrites the election key and compares the
revision the previous one left there, so a duplicate of an older write that etcd receives late
(an attempt the client gave up on, delivered after the retry that succeeded and after newer
writes) finds the key changed and does nothing: it can never put back an older state. When a
write's compare fails while the key is still this replica's, an earlier attempt of that same
write was applied (nothing else writes the key), and the write counts as done.

A replica's leadership is a state machine: NEW -> STANDBY (`register`: the
lease is granted and kept alive) -> ACTIVE (`campaign` won) -> ENDED. ENDED has
one way in, `end(reason, revoke)`, from any state: the lease was not renewed in
time, a fenced write was refused (another replica holds the role), or the
replica stops (`revoke`: the role and the registration go at once, a standby
takes over). Nothing leaves ENDED: a replica that lost its role starts afresh
as a new process (replication/replica.py).

`held()` is the replica's own, conservative view, and only reads: the lease
counts from before the keepalive that renewed it was sent, so the replica
gives up the role no later than etcd expires it. A replica that was paused
(SIGSTOP, a long GC, a partition) past its lease finds `held()` false as soon
as it runs again, before it handles anything; `why_not_held()` says why.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from elastic_control_plane.replication.etcd import (
    MAX_TXN_OPS,
    EtcdClient,
    EtcdError,
    EtcdRefused,
    TxnResult,
    create_revision_is,
    mod_revision_is,
    put_op,
    range_op,
    space_exceeded,
)
from elastic_control_plane.replication.space import RECLAIMS

# Keepalives per lease: one every TTL/KEEPALIVES_PER_TTL; two may be lost before the lease is in danger.
KEEPALIVES_PER_TTL = 4
# The active replica compacts etcd's history every COMPACT_EVERY revisions, keeping the last KEEP_REVISIONS (watches
# of ours resume within a few revisions; a standby watches from what it read); and once it has written COMPACT_BYTES
# (keys and values) since its last compaction, keeping the history since that one. Revisions alone do not bound the
# bytes: a reset of 1,024 hosts x 8 slots writes about 470 KB in 9 revisions and grew the database by about 700 KB,
# so a 64 MiB quota filled within about 100 resets, long before 10,000 revisions (bench/etcd_size.py).
COMPACT_EVERY = 10_000
KEEP_REVISIONS = 1_000
COMPACT_BYTES = 256 * 1024
MAX_WRITE_OPS = MAX_TXN_OPS - 1  # a fenced write's own operations: the last of the txn rewrites the election key


@dataclass(frozen=True)
class ElectionTiming:
    """Every interval of a replica's election, in one place and checked together when it is made (as client-go's
    leader election checks lease > renew deadline > retry period): the lease (etcd's TTL, whole seconds), a keepalive
    every `keepalive_s` (two may be lost before the lease is in danger), an etcd call that failed or a campaign that
    lost tried again every `retry_s`, at most `revoke_s` to give the lease back, and a fenced write given at least
    `least_write_s` even when the lease has less left."""

    lease_s: int
    retry_s: float = 0.2
    revoke_s: float = 1.0
    least_write_s: float = 0.3

    def __post_init__(self) -> None:
        if not isinstance(self.lease_s, int) or self.lease_s < 1:
            raise ValueError(f"the lease must be a whole number of seconds, at least 1 (got {self.lease_s!r})")
        if not self.lease_s > 2 * self.keepalive_s > self.retry_s > 0:
            raise ValueError(
                f"an election needs lease ({self.lease_s} s) > two keepalives ({2 * self.keepalive_s:g} s) > "
                f"retry ({self.retry_s:g} s) > 0"
            )
        if not 0 < self.least_write_s < self.lease_s or not 0 < self.revoke_s <= self.lease_s:
            raise ValueError("a fenced write's least deadline and the revoke's must lie within the lease")

    @property
    def keepalive_s(self) -> float:
        return self.lease_s / KEEPALIVES_PER_TTL


NEW, STANDBY, ACTIVE, ENDED = "new", "standby", "active", "ended"
_NEXT = {NEW: (STANDBY, ENDED), STANDBY: (ACTIVE, ENDED), ACTIVE: (ENDED,), ENDED: ()}


def leader_key(prefix: str, service: str) -> bytes:
    return f"{prefix}/leader/{service}".encode()


def replica_key(prefix: str, service: str, replica: str) -> bytes:
    return f"{prefix}/replicas/{service}/{replica}".encode()


class Outage:
    """Says once that etcd is out of reach (`etcd_unreachable`), and once that it answers again. A refusal for space
    is not waited out: the replica reclaims it (`SpaceReclaims`), whatever its state, since while etcd is full no
    replica can register or campaign, and none may be active to do it."""

    def __init__(self, log: structlog.stdlib.BoundLogger) -> None:
        self.log = log
        self.since: float | None = None

    def failed(self, exc: Exception, client: EtcdClient | None = None) -> None:
        if self.since is None:
            self.since = time.monotonic()
            self.log.warning("etcd_unreachable", reason=str(exc))
        if client is not None and space_exceeded(exc):
            try:
                RECLAIMS.reclaim(client, self.log)
            except EtcdError as failure:
                self.log.warning("etcd_space_not_reclaimed", reason=str(failure))

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
        timing: ElectionTiming,
        clock: Callable[[], float] = time.monotonic,
        log: structlog.stdlib.BoundLogger | None = None,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.service = service
        self.replica = replica
        self.key = leader_key(prefix, service)
        self.timing = timing
        self.clock = clock
        self.log = log or structlog.get_logger().bind(process=service)
        self.record = {"replica": replica, "pid": os.getpid(), "address": address, "since": time.time()}
        self.state = NEW
        self.lease = 0
        self.revision = 0  # the election key's create revision once this replica won the role; 0 before
        self.written = 0  # the revision of the election key's last write: the campaign's, then each `write`'s
        self.end_reason = ""
        self._valid_until = 0.0
        self._compacted_at = 0  # the revision of this replica's last compaction
        self._bytes_since_compaction = 0  # the bytes (keys and values) this replica wrote since then
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
                self.lease, granted = self.client.lease_grant(self.timing.lease_s)
                self._valid_until = sent + granted
                self.client.put(replica_key(self.prefix, self.service, self.replica), self._record(), lease=self.lease)
                break
            except EtcdError as exc:
                self.outage.failed(exc, self.client)
                stop.wait(self.timing.retry_s)
        else:
            return False
        self.outage.ended()
        self._enter(STANDBY)
        self._keeper = threading.Thread(target=self._keep_alive, name="lease-keepalive", daemon=True)
        self._keeper.start()
        return True

    def _record(self, **extra: Any) -> bytes:
        return json.dumps({**self.record, **extra}, sort_keys=True).encode()

    def _keep_alive(self) -> None:
        """Renew the lease every keepalive interval, on a client of its own (a write that takes long never delays a
        renewal), until the leadership ends."""
        renewals = self.client.sibling()
        try:
            while not self._stop.wait(self.timing.keepalive_s):
                sent = self.clock()
                try:
                    left = renewals.lease_keepalive(self.lease, deadline=max(0.1, self._valid_until - sent))
                except EtcdError as exc:
                    if self.clock() >= self._valid_until:
                        self.end(f"the lease could not be renewed: {exc}")
                        return
                    continue
                if left <= 0:
                    self.end("the lease expired")
                    return
                self._valid_until = sent + left
        finally:
            renewals.close()

    def _enter(self, state: str) -> None:
        if state not in _NEXT[self.state]:
            raise RuntimeError(f"{self.service}: leadership cannot go from {self.state} to {state}")
        self.state = state

    def end(self, reason: str, revoke: bool = False) -> None:
        """The one way out, from any state (a second end keeps the first reason): stop renewing the lease, and with
        `revoke` give the lease back so the role and the registration go at once and a standby takes over."""
        if self.state == ENDED:
            return
        self.end_reason = reason
        self._enter(ENDED)
        self._stop.set()
        if revoke and self.lease:
            try:
                self.client.lease_revoke(self.lease, deadline=self.timing.revoke_s)
            except EtcdError as exc:
                self.log.warning("lease_not_revoked", reason=str(exc))

    def held(self) -> bool:
        """Whether this replica holds the lease by its own clock (and, once elected, the role); it changes nothing."""
        return self.state in (STANDBY, ACTIVE) and self.clock() < self._valid_until

    def why_not_held(self) -> str:
        """Why `held()` is false ("" while it is true)."""
        if self.state == ENDED:
            return self.end_reason
        if self.state == NEW:
            return "not registered"
        if self.clock() >= self._valid_until:
            return f"the lease was not renewed for {self.timing.lease_s} s (paused or cut off from etcd)"
        return ""

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
                    holder, read_at = self.client.get_at(self.key)
                    if holder is None:
                        continue
                    if holder.lease != self.lease:
                        self._wait_for_deletion(read_at + 1, stop)  # not the key's own revision: compacted long ago
                        continue
                    # A retried txn whose first attempt won: the key is this replica's.
                self.revision = won.revision if won.succeeded else holder.create_revision
                self.written = won.revision if won.succeeded else holder.mod_revision
                self.client.put(
                    replica_key(self.prefix, self.service, self.replica), self._record(active=True), lease=self.lease
                )
                if not self.held():
                    return False
                self._enter(ACTIVE)
                return True
            except EtcdError as exc:
                self.outage.failed(exc, self.client)
                stop.wait(self.timing.retry_s)
        return False

    def _wait_for_deletion(self, start_revision: int, stop: threading.Event) -> None:
        """Return once the election key is deleted, or `stop` is set, or this replica's lease is lost."""
        watching = threading.Event()

        def until_stopped() -> None:
            while not stop.is_set() and not self._stop.is_set() and not watching.is_set():
                stop.wait(self.timing.retry_s)
            watching.set()

        threading.Thread(target=until_stopped, daemon=True).start()
        try:
            for _, events in self.client.watch(self.key, start_revision=start_revision, stop=watching):
                if any(event.kind == "delete" for event in events):
                    return
        finally:
            watching.set()

    def fence(self) -> list[dict[str, Any]]:
        """The compares every write of the active replica carries: the election key is still the one it created, as
        its previous write left it."""
        return [create_revision_is(self.key, self.revision), mod_revision_is(self.key, self.written)]

    def write(self, ops: list[dict[str, Any]]) -> int:
        """Apply `ops` in one txn fenced by this replica's role; the revision it made. A refused fence ends the
        leadership (`end`) and raises `LostRole`; etcd out of reach past the lease raises `EtcdError`."""
        if self.state != ACTIVE or not self.held():
            raise LostRole(f"{self.service}: this replica no longer holds the role ({self.why_not_held()})")
        try:
            result = self._fenced(ops)
        except EtcdRefused as exc:
            if not space_exceeded(exc):
                raise
            self._reclaim_space(exc)
            result = self._fenced(ops)
        if result.succeeded:
            self.written = result.revision
        elif self._applied_before(result):
            self.written = result.responses[0]["response_range"]["kvs"][0].mod_revision
        else:
            self.end("another replica holds the role: a write was refused")
            raise LostRole(f"{self.service}: another replica holds the role; this one stepped down")
        self._bytes_since_compaction += written_bytes(ops)
        if self.written - self._compacted_at >= COMPACT_EVERY or self._bytes_since_compaction >= COMPACT_BYTES:
            self._compact(self.written)
        return self.written

    def _fenced(self, ops: list[dict[str, Any]]) -> TxnResult:
        """The write, ordered after this replica's previous one; refused, it reads the election key."""
        deadline = max(self.timing.least_write_s, self._valid_until - self.clock())
        rewrite = put_op(self.key, self._record(), lease=self.lease)
        return self.client.txn(self.fence(), [*ops, rewrite], [range_op(self.key)], deadline=deadline)

    def _applied_before(self, refused: TxnResult) -> bool:
        """A refused write whose election key is still this replica's: an earlier attempt of it was applied."""
        kvs = refused.responses[0]["response_range"]["kvs"] if refused.responses else []
        return bool(kvs) and kvs[0].create_revision == self.revision and kvs[0].mod_revision > self.written

    def _reclaim_space(self, refusal: EtcdRefused) -> None:
        """etcd refused the write for space: compact, defragment and disarm (SpaceReclaims), said once each time,
        then the write goes once more (an EtcdError if etcd still refuses it); within the backoff after a reclaim
        that freed nothing, the refusal stands."""
        self.log.warning("etcd_space_exceeded", reason=refusal.message)
        if not RECLAIMS.reclaim(self.client, self.log):
            raise refusal
        self._compacted_at = 0

    def _compact(self, revision: int) -> None:
        """Keep etcd's history bounded whoever started its members (those we start also compact every 10 minutes):
        every COMPACT_EVERY revisions the history older than the last KEEP_REVISIONS goes, and every COMPACT_BYTES
        written the history older than this replica's last compaction (whichever keeps less)."""
        try:
            target = max(revision - KEEP_REVISIONS, self._compacted_at)
            if target > 0:
                self.client.compact(target)
            self._compacted_at, self._bytes_since_compaction = revision, 0
        except EtcdError as exc:
            self.log.warning("etcd_not_compacted", reason=str(exc))


def written_bytes(ops: list[dict[str, Any]]) -> int:
    """The bytes of the keys and values that `ops` put (base64 in the request: three bytes in four characters)."""
    puts = [op["request_put"] for op in ops if "request_put" in op]
    return sum(len(put["key"]) + len(put.get("value", "")) for put in puts) * 3 // 4


class LostRole(EtcdError):
    """A fenced write was refused: another replica was elected, and this one must not write again."""
