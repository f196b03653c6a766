"""Clients of services: a blocking Lazy-Pirate client and a non-blocking one that lives in a Service loop.

`Client.request` sends, waits up to `timeout`, and on silence closes the
socket, opens a new one and resends the same request id (services answer a
retry from their reply cache), until `deadline` passes: then `Unreachable`.
An error reply raises `ServiceError`.

`AsyncClient` does the same without blocking: replies arrive through the owning
Service's poll loop and are handed to callbacks.

An endpoint may be an endpoint list (bus/config.py): the socket connects to every replica of the service and sends
only once a connection to the bound one has completed (bus/sockets.py). Until then `Client.request` waits for room
within its attempt, and `AsyncClient` keeps the request and tries again at its next resend tick.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import zmq

from elastic_control_plane.bus.envelope import Message, WireError, decode, encode
from elastic_control_plane.bus.sockets import Security, client_socket


class Unreachable(ConnectionError):
    """No reply from an endpoint (list) within the deadline."""

    def __init__(self, endpoint: str, waited: float) -> None:
        super().__init__(f"no reply from {endpoint} within {waited:.1f}s")
        self.endpoint = endpoint


class ServiceError(RuntimeError):
    """A service answered with an error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_request_ids = itertools.count(1)  # one sequence per process: clients sharing a sender id never reuse a request id


def incarnation_id(role: str, name: str = "") -> str:
    """A sender id unique to this process's life: peers tell a restart from a slow peer."""
    return f"{role}:{name}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _send_before(sock: zmq.Socket, frames: list[bytes], until: float) -> bool:
    """Send `frames` as soon as the socket has a connection to take them, if that is before `until`."""
    while True:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            left = until - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLOUT):
                return False


def _check(reply: Message) -> Message:
    if reply.error is not None:
        raise ServiceError(str(reply.error), str(reply.body.get("message", "")))
    return reply


class Client:
    """Blocking request/reply over a DEALER. Thread-safe (one request at a time)."""

    def __init__(
        self,
        endpoint: str,
        sender: str,
        *,
        security: Security = Security(),
        timeout: float = 2.0,
        deadline: float | None = None,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.sender = sender
        self.security = security
        self.timeout = timeout
        self.deadline = deadline if deadline is not None else timeout * 2
        self._ctx = ctx or zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = client_socket(self._ctx, zmq.DEALER, self.endpoint, self.security)
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def request(
        self,
        msg_type: str,
        body: dict[str, Any] | None = None,
        *,
        round: int | None = None,
        raw: tuple[bytes, ...] = (),
        timeout: float | None = None,
        deadline: float | None = None,
    ) -> Message:
        timeout = self.timeout if timeout is None else timeout
        deadline = self.deadline if deadline is None else deadline
        with self._lock:
            msg = Message(
                type=msg_type, body=body or {}, id=str(next(_request_ids)), round=round, sender=self.sender, raw=raw
            )
            frames = encode(msg)
            started = time.monotonic()
            while True:
                sock = self._socket()
                attempt_end = min(time.monotonic() + timeout, started + deadline)
                sent = _send_before(sock, frames, attempt_end)
                while sent and (left := attempt_end - time.monotonic()) > 0:
                    if not sock.poll(int(left * 1000) + 1):
                        continue
                    try:
                        reply = decode(sock.recv_multipart())
                    except WireError:
                        continue
                    if reply.reply and reply.id == msg.id:
                        return _check(reply)
                    if reply.type == "error" and reply.id == "":
                        return _check(reply)
                self._reset()
                if time.monotonic() - started >= deadline:
                    raise Unreachable(self.endpoint, time.monotonic() - started)

    def close(self) -> None:
        with self._lock:
            self._reset()


# Refusals that say "not now" (the service could not write what the request asked, its store refused or was out of
# reach): a request sent with `retry_refused` is tried again after a backoff instead of being answered with them.
TEMPORARY_REFUSALS = frozenset({"unavailable"})
RETRY_BACKOFF_FIRST = 0.2
RETRY_BACKOFF_MAX = 5.0


@dataclass
class _Pending:
    msg: Message
    frames: list[bytes]
    on_reply: Callable[[Message], None] | None
    on_timeout: Callable[[], None] | None
    timeout: float
    resend_at: float
    give_up_at: float | None
    retry_refused: Callable[[Message], None] | None = None  # told of each temporary refusal before the retry
    refusals: int = 0


class AsyncClient:
    """Non-blocking requests from inside a Service loop; resends until a reply or the deadline. A request that finds
    no connection to take it is sent at the next resend tick. The number of requests without a reply yet is the
    metric `elastic_client_requests_in_flight` (bus/metrics.py)."""

    def __init__(self, service: Any, endpoint: str, sender: str, security: Security = Security()) -> None:
        # Imported here, not at the top: elasticctl and libworker import this module but never make an AsyncClient,
        # and importing prometheus-client would add some 70 ms to their start.
        from elastic_control_plane.bus.metrics import CLIENT_REQUESTS_IN_FLIGHT

        self.endpoint = endpoint
        self.sender = sender
        self._service = service
        self._sock = client_socket(service.ctx, zmq.DEALER, endpoint, security)
        self._pending: dict[str, _Pending] = {}
        self._in_flight_gauge = CLIENT_REQUESTS_IN_FLIGHT.labels(service.name, endpoint)
        service.watch(self._sock, self._on_readable)
        service.every(0.05, self._resend_due)

    def send(
        self,
        msg_type: str,
        body: dict[str, Any] | None = None,
        *,
        round: int | None = None,
        raw: tuple[bytes, ...] = (),
        on_reply: Callable[[Message], None] | None = None,
        on_timeout: Callable[[], None] | None = None,
        timeout: float = 2.0,
        deadline: float | None = None,
        retry_refused: Callable[[Message], None] | None = None,
    ) -> str:
        """Send a request, again after each `timeout` without a reply, until `deadline` (then `on_timeout`). With
        `retry_refused`, a temporary refusal (TEMPORARY_REFUSALS) is not a reply: `retry_refused` is told of it and
        the request goes again, as a new one (the service keeps its refusal under the old id), after a backoff that
        doubles from RETRY_BACKOFF_FIRST to RETRY_BACKOFF_MAX."""
        msg_id = str(next(_request_ids))
        msg = Message(type=msg_type, body=body or {}, id=msg_id, round=round, sender=self.sender, raw=raw)
        now = time.monotonic()
        pending = _Pending(
            msg,
            encode(msg),
            on_reply,
            on_timeout,
            timeout,
            now,
            None if deadline is None else now + deadline,
            retry_refused,
        )
        self._pending[msg_id] = pending
        self._in_flight_gauge.set(len(self._pending))
        self._send(pending, now)
        return msg_id

    def _send(self, pending: _Pending, now: float) -> None:
        """Send a request, to be sent again after its timeout; or at the next tick if no connection can take it."""
        try:
            self._sock.send_multipart(pending.frames, zmq.NOBLOCK)
        except zmq.Again:
            pending.resend_at = now
            return
        pending.resend_at = now + pending.timeout

    def cancel(self, msg_id: str) -> None:
        """Stop waiting for a request's reply (it is no longer sent again; a reply that comes is dropped)."""
        if self._pending.pop(msg_id, None) is not None:
            self._in_flight_gauge.set(len(self._pending))

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    def _on_readable(self) -> None:
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = decode(frames)
            except WireError:
                continue
            pending = self._pending.pop(reply.id, None)
            if pending is not None and pending.retry_refused is not None and reply.error in TEMPORARY_REFUSALS:
                self._retry_later(pending, reply)
            elif pending is not None and pending.on_reply is not None:
                pending.on_reply(reply)
            self._in_flight_gauge.set(len(self._pending))

    def _retry_later(self, pending: _Pending, refusal: Message) -> None:
        """A temporary refusal: the same request under a new id, sent after the backoff (its deadline unchanged)."""
        assert pending.retry_refused is not None
        pending.retry_refused(refusal)
        pending.refusals += 1
        retry_id = str(next(_request_ids))
        pending.msg = replace(pending.msg, id=retry_id)
        pending.frames = encode(pending.msg)
        backoff = min(RETRY_BACKOFF_MAX, RETRY_BACKOFF_FIRST * 2 ** (pending.refusals - 1))
        pending.resend_at = time.monotonic() + backoff
        self._pending[retry_id] = pending

    def _resend_due(self) -> None:
        now = time.monotonic()
        for msg_id, pending in list(self._pending.items()):
            if pending.give_up_at is not None and now >= pending.give_up_at:
                del self._pending[msg_id]
                self._in_flight_gauge.set(len(self._pending))
                if pending.on_timeout is not None:
                    pending.on_timeout()
            elif now >= pending.resend_at:
                self._send(pending, now)
