"""EtcdClient: etcd v3 through its HTTP/JSON gateway, over the standard library, failing over between members.

Every call goes to the member that answered last; a timeout, a lost connection or an answer meaning "not now" (gRPC
Unavailable or DeadlineExceeded, "too many requests": an election) moves it to the next member, round and round,
until the call's deadline: then `EtcdUnavailable`. The first round waits `request_timeout` per member (0.3 s: a
leader's death stops writes for about a second, and a member without a leader holds a request for seconds), each
later round twice as long, so a slow disk is not taken for a dead member; a big request gets `SECONDS_PER_MIB` more
per MiB (the gateway decodes a 7 MiB put in 0.65 s on an idle machine). Any other error answer raises `EtcdRefused`.

How requests and answers are spelled is replication/etcd_wire.py's business; its record types and txn builders are
imported here, so that callers import this module only. Given `tls` (replication/etcd_tls.py), it speaks HTTPS.

A retried request may have been applied by the member that did not answer. Callers therefore send requests that
are safe to repeat: puts and txns of absolute values (a value, never an increment), which applied twice leave what
applying them once leaves. A txn whose compare holds only once (`create_revision_is(key, 0)`) reports failure when
its first attempt was applied: the caller reads the key to learn whose write it holds. A retried `lease_grant` may
leave an unused lease behind, which expires; a retried `delete` counts 0.
"""

from __future__ import annotations

import http.client
import itertools
import json
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from elastic_control_plane.replication.etcd_wire import (
    GatewayFailure,
    KeyValue,
    Member,
    TxnResult,
    WatchEvent,
    b64,
    create_revision_is,
    decode_events,
    decode_member,
    decode_range,
    decode_status,
    decode_txn,
    delete_op,
    header_revision,
    key_range,
    mod_revision_is,
    one_line,
    parse_endpoints,
    prefix_end,
    put_op,
    range_op,
    read_answer,
    split_endpoint,
    value_is,
)

__all__ = [
    "EtcdClient",
    "EtcdError",
    "EtcdRefused",
    "EtcdUnavailable",
    "KeyValue",
    "Member",
    "TxnResult",
    "WatchEvent",
    "create_revision_is",
    "delete_op",
    "mod_revision_is",
    "parse_endpoints",
    "prefix_end",
    "put_op",
    "range_op",
    "value_is",
]

GRPC_NOT_FOUND = 5
GRPC_RESOURCE_EXHAUSTED = 8
GRPC_OUT_OF_RANGE = 11
SECONDS_PER_MIB = 0.25  # added to an attempt's timeout per MiB of request: 2.5 times what an idle machine needs
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops: operations per txn branch, compares alike
RANGE_PAGE = 1000  # keys per range request of get_prefix: a big prefix is read in pages, all at one revision
_HEADERS = {"Content-Type": "application/json"}


class EtcdError(RuntimeError):
    """A call to etcd failed; the message (one line) names the endpoints and what failed."""


class EtcdUnavailable(EtcdError):
    """No member answered within the call's deadline."""


class EtcdRefused(EtcdError):
    """A member answered with an error: `code` is the gRPC status code, `message` etcd's text."""

    def __init__(self, endpoint: str, path: str, code: int, message: str) -> None:
        super().__init__(f"etcd {endpoint} refused {path}: {message} (gRPC code {code})")
        self.code, self.message = code, message


def space_exceeded(exc: BaseException) -> bool:
    """Is `exc` etcd refusing a write because its backend reached its quota (the NOSPACE alarm is raised)?"""
    return isinstance(exc, EtcdRefused) and exc.code == GRPC_RESOURCE_EXHAUSTED and "space exceeded" in exc.message


class TxnTooLarge(ValueError):
    """A txn over etcd's limit of operations: its caller must make it smaller (range deletes, fewer parts)."""


def _reason(exc: BaseException) -> str:
    return one_line(f"{type(exc).__name__}: {exc}") if str(exc) else type(exc).__name__


class EtcdClient:
    """A client of one etcd cluster. Thread-safe: one request at a time per client; a watch has its own connections."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        request_timeout: float = 0.3,
        deadline: float = 5.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.endpoints = parse_endpoints(",".join(endpoints))
        self.request_timeout = request_timeout
        self.deadline = deadline
        self.tls = tls
        self._preferred = 0  # the member that answered last
        self._connections: dict[str, http.client.HTTPConnection] = {}
        self._lock = threading.Lock()

    def _connect(self, endpoint: str, timeout: float) -> http.client.HTTPConnection:
        host, port = split_endpoint(endpoint)
        if self.tls is None:
            return http.client.HTTPConnection(host, port, timeout=timeout)
        return http.client.HTTPSConnection(host, port, timeout=timeout, context=self.tls)

    def _post(self, endpoint: str, path: str, body: bytes, timeout: float) -> dict[str, Any]:
        connection = self._connections.get(endpoint)
        if connection is None:
            connection = self._connect(endpoint, timeout)
            self._connections[endpoint] = connection
        connection.timeout = timeout
        if connection.sock is not None:
            connection.sock.settimeout(timeout)
        try:
            connection.request("POST", path, body, _HEADERS)
            response = connection.getresponse()
            status, data = response.status, response.read()
        except (OSError, http.client.HTTPException):
            connection.close()
            del self._connections[endpoint]
            raise
        return read_answer(status, data)

    def _call(self, path: str, request: dict[str, Any], deadline: float | None) -> dict[str, Any]:
        body = json.dumps(request).encode()
        allowance = SECONDS_PER_MIB * len(body) / 2**20
        started = time.monotonic()
        give_up = started + (self.deadline if deadline is None else deadline)
        failures: dict[str, str] = {}
        with self._lock:
            for attempt in itertools.count():
                rounds = attempt // len(self.endpoints)
                if attempt and attempt % len(self.endpoints) == 0:  # every member failed: breathe before the next round
                    time.sleep(max(0.0, min(0.05 * rounds, 0.25, give_up - time.monotonic())))
                left = give_up - time.monotonic()
                if attempt and left <= 0:
                    break
                endpoint = self.endpoints[self._preferred]
                timeout = max(0.01, min(self.request_timeout * 2**rounds + allowance, left))
                try:
                    answer = self._post(endpoint, path, body, timeout)
                except (OSError, http.client.HTTPException) as exc:
                    failures[endpoint] = _reason(exc)
                except GatewayFailure as failure:
                    if not failure.retried:
                        raise EtcdRefused(endpoint, path, failure.code, failure.message) from None
                    failures[endpoint] = f"{failure.message} (gRPC code {failure.code})"
                else:
                    return answer
                self._preferred = (self._preferred + 1) % len(self.endpoints)
        tried = "; ".join(f"{endpoint}: {reason}" for endpoint, reason in failures.items())
        raise EtcdUnavailable(f"no etcd member answered {path} within {time.monotonic() - started:.1f}s ({tried})")

    def get(self, key: bytes, *, deadline: float | None = None) -> KeyValue | None:
        return self.get_at(key, deadline=deadline)[0]

    def get_at(self, key: bytes, *, deadline: float | None = None) -> tuple[KeyValue | None, int]:
        """The key (None when absent) and the revision it was read at: a watch from the revision after misses
        nothing, and starts within etcd's history however old the key (a key's own revisions may be compacted)."""
        kvs, revision, _ = decode_range(self._call("/v3/kv/range", key_range(key, False), deadline))
        return (kvs[0] if kvs else None), revision

    def get_prefix(self, prefix: bytes, *, deadline: float | None = None) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` in key order, and the revision they were read at (one revision for all pages)."""
        request: dict[str, Any] = {**key_range(prefix, True), "limit": str(RANGE_PAGE)}
        kvs, revision, more = decode_range(self._call("/v3/kv/range", request, deadline))
        while more:
            request.update(key=b64(kvs[-1].key + b"\0"), revision=str(revision))
            page, _, more = decode_range(self._call("/v3/kv/range", request, deadline))
            kvs.extend(page)
        return kvs, revision

    def put(self, key: bytes, value: bytes, *, lease: int = 0, deadline: float | None = None) -> int:
        """Sets `key` to `value` (attached to `lease` when non-zero); the store's revision after the put."""
        return header_revision(self._call("/v3/kv/put", put_op(key, value, lease)["request_put"], deadline))

    def delete(self, key: bytes, *, prefix: bool = False, deadline: float | None = None) -> int:
        """The number of keys deleted (0 when a retried delete had already been applied)."""
        answer = self._call("/v3/kv/deleterange", key_range(key, prefix), deadline)
        return int(answer.get("deleted", 0))

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: Sequence[dict[str, Any]] = (),
        *,
        deadline: float | None = None,
    ) -> TxnResult:
        """Runs `success` if every compare holds, else `failure`, in one revision. A txn over etcd's limit of
        operations is a bug of its caller, never sent: TxnTooLarge."""
        for name, ops in (("compares", compare), ("success operations", success), ("failure operations", failure)):
            if len(ops) > MAX_TXN_OPS:
                raise TxnTooLarge(f"a txn of {len(ops)} {name}: etcd takes {MAX_TXN_OPS} at most (--max-txn-ops)")
        request = {"compare": compare, "success": success, "failure": list(failure)}
        return decode_txn(self._call("/v3/kv/txn", request, deadline))

    def lease_grant(self, ttl: int, *, deadline: float | None = None) -> tuple[int, int]:
        """A new lease: (its id, the ttl granted, which etcd may raise to its minimum)."""
        answer = self._call("/v3/lease/grant", {"TTL": str(ttl)}, deadline)
        return int(answer.get("ID", 0)), int(answer.get("TTL", 0))

    def lease_keepalive(self, lease: int, *, deadline: float | None = None) -> int:
        """Renews `lease`: the ttl it has now, 0 when it is gone (expired or revoked)."""
        return int(self._call("/v3/lease/keepalive", {"ID": str(lease)}, deadline).get("TTL", 0))

    def compact(self, revision: int, *, deadline: float | None = None) -> None:
        """Drop the history before `revision` (a revision already compacted is not an error)."""
        self._call_done_before("/v3/kv/compaction", {"revision": str(revision)}, deadline, GRPC_OUT_OF_RANGE)

    def lease_revoke(self, lease: int, *, deadline: float | None = None) -> None:
        """Revokes `lease`, deleting its keys; a lease already gone is not an error."""
        self._call_done_before("/v3/lease/revoke", {"ID": str(lease)}, deadline, GRPC_NOT_FOUND)

    def _call_done_before(self, path: str, request: dict[str, Any], deadline: float | None, done_code: int) -> None:
        """A call whose refusal with `done_code` means that what it asks was done already."""
        try:
            self._call(path, request, deadline)
        except EtcdRefused as exc:
            if exc.code != done_code:
                raise

    def members(self, *, deadline: float | None = None) -> list[Member]:
        return [decode_member(m) for m in self._call("/v3/cluster/member/list", {}, deadline).get("members", [])]

    def member_add(self, peer_urls: list[str], *, deadline: float | None = None) -> Member:
        """Adds a member (to be started with --initial-cluster-state existing). A retry that finds the member it
        added already there answers that member."""
        try:
            return decode_member(self._call("/v3/cluster/member/add", {"peerURLs": peer_urls}, deadline)["member"])
        except EtcdRefused as exc:
            if "already exists" not in exc.message:
                raise
            added = [member for member in self.members(deadline=deadline) if member.peer_urls == peer_urls]
            if not added:
                raise
            return added[0]

    def member_remove(self, member_id: int, *, deadline: float | None = None) -> None:
        """Removes a member from the cluster; one that is not (or no longer) a member is not an error."""
        try:
            self._call("/v3/cluster/member/remove", {"ID": str(member_id)}, deadline)
        except EtcdRefused as exc:
            if exc.code != GRPC_NOT_FOUND:
                raise

    def reclaim_space(self, *, member_timeout: float = 60.0) -> tuple[int, int]:
        """What an operator does when etcd refuses writes for space, done here: compact every revision before the
        current one, defragment the members one at a time (a member defragmenting answers nothing), and disarm their
        NOSPACE alarms. The largest backend before and after, in bytes. EtcdError when a step fails."""
        before = self._largest_backend()
        self.compact(self.get_at(b"\0")[1])
        for endpoint in self.endpoints:
            self.call_member(endpoint, "/v3/maintenance/defragment", {}, member_timeout)
        for alarm in self.alarms():
            if alarm.get("alarm") == "NOSPACE":
                request = {"action": "DEACTIVATE", "memberID": str(alarm.get("memberID", 0)), "alarm": "NOSPACE"}
                self._call("/v3/maintenance/alarm", request, None)
        return before, self._largest_backend()

    def alarms(self, *, deadline: float | None = None) -> list[dict[str, Any]]:
        """The alarms raised on the members, as etcd lists them: {"memberID", "alarm"} (NOSPACE: a backend at quota)."""
        return self._call("/v3/maintenance/alarm", {"action": "GET"}, deadline).get("alarms") or []

    def _largest_backend(self) -> int:
        sizes = [status["db_size"] for endpoint in self.endpoints if (status := self.endpoint_status(endpoint))]
        return max(sizes, default=0)

    def call_member(self, endpoint: str, path: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """A call that only `endpoint` must answer (a member's own maintenance)."""
        with self._lock:
            try:
                return self._post(endpoint, path, json.dumps(request).encode(), timeout)
            except GatewayFailure as failure:
                raise EtcdRefused(endpoint, path, failure.code, failure.message) from None
            except (OSError, http.client.HTTPException) as exc:
                raise EtcdUnavailable(f"etcd {endpoint} did not answer {path}: {_reason(exc)}") from None

    def endpoint_status(self, endpoint: str, *, timeout: float = 0.5) -> dict[str, int] | None:
        """{"member_id", "leader", "revision", "db_size", "db_size_in_use"} as that one member sees them (the
        database file's bytes, and those holding live data: the rest a defragmentation gives back); None if it does
        not answer."""
        connection = self._connect(endpoint, timeout)
        try:
            connection.request("POST", "/v3/maintenance/status", b"{}", _HEADERS)
            response = connection.getresponse()
            return decode_status(read_answer(response.status, response.read()))
        except (OSError, http.client.HTTPException, GatewayFailure):
            return None
        finally:
            connection.close()

    def watch(
        self, key: bytes, *, prefix: bool = False, start_revision: int, stop: threading.Event, idle_timeout: float = 3.0
    ) -> Iterator[tuple[int, list[WatchEvent]]]:
        """Every change to `key` (or under it) from `start_revision` on, as (revision, events): the revision is its
        last event's, the events those of one watch answer, in order.

        A stream that ends, fails, or says nothing for `idle_timeout` (members send a progress notification every
        second) is resumed on the next member from the revision after the last one delivered, so every event is
        delivered exactly once. Returns once `stop` is set (seen within `idle_timeout`). A start revision etcd has
        compacted raises EtcdRefused (code 11, OutOfRange): read the keys afresh and watch from there.
        """
        next_revision = start_revision
        member = self._preferred
        failed_in_a_row = 0
        while not stop.is_set():
            endpoint = self.endpoints[member % len(self.endpoints)]
            try:
                for revision, events in self._watch_stream(endpoint, key, prefix, next_revision, stop, idle_timeout):
                    next_revision = revision + 1
                    failed_in_a_row = 0
                    yield revision, events
            except (OSError, http.client.HTTPException, GatewayFailure):
                pass  # resumed below on the next member
            member += 1
            failed_in_a_row += 1
            if failed_in_a_row >= len(self.endpoints):
                stop.wait(min(0.05 * failed_in_a_row, 0.5))

    def _watch_stream(
        self, endpoint: str, key: bytes, prefix: bool, start: int, stop: threading.Event, idle_timeout: float
    ) -> Iterator[tuple[int, list[WatchEvent]]]:
        request = {"create_request": {**key_range(key, prefix), "start_revision": str(start), "progress_notify": True}}
        connection = self._connect(endpoint, self.request_timeout)
        try:
            connection.request("POST", "/v3/watch", json.dumps(request).encode(), _HEADERS)
            if connection.sock is not None:
                connection.sock.settimeout(idle_timeout)
            response = connection.getresponse()
            if response.status != 200:
                read_answer(response.status, response.read())
                return
            while not stop.is_set():
                line = response.readline()
                if not line:
                    return
                result = read_answer(200, line)
                if result.get("canceled"):
                    if int(result.get("compact_revision", 0)):
                        message = f"watch from revision {start}: compacted up to {result['compact_revision']}"
                        raise EtcdRefused(endpoint, "/v3/watch", GRPC_OUT_OF_RANGE, message)
                    return
                events = [event for event in decode_events(result) if event.kv.mod_revision >= start]
                if events:
                    start = events[-1].kv.mod_revision + 1
                    yield events[-1].kv.mod_revision, events
        except GatewayFailure as failure:
            if not failure.retried:
                raise EtcdRefused(endpoint, "/v3/watch", failure.code, failure.message) from None
            raise
        finally:
            connection.close()

    def sibling(self) -> EtcdClient:
        """Another client of the same members, with connections and a lock of its own: its requests never wait
        behind this one's (a lease's keepalives behind a large write)."""
        return EtcdClient(
            list(self.endpoints), request_timeout=self.request_timeout, deadline=self.deadline, tls=self.tls
        )

    def close(self) -> None:
        with self._lock:
            for connection in self._connections.values():
                connection.close()
            self._connections.clear()
