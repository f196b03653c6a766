"""The Service base: one ROUTER loop, a handler per message type, deferred replies, timers.

A subclass marks methods with `@handles("type")`, or `@handles("type", roles=...)`
for a handler only some callers may use (bus/roles.py: anyone else gets
`forbidden`), and `replayable=True` for one a retry may simply run again (a read,
a heartbeat): its answers are not kept. A handler receives a `Request`
and returns the reply body (a dict), or `DEFERRED` to park the request and
answer it later with `request.reply(...)`. `RequestError` becomes an error
reply; any other exception is logged and becomes an `internal` error reply, so
nothing a peer sends stops the loop.

Retried requests are idempotent: a request with the same (sender, id), from the
same authenticated key, as one already answered gets the cached answer again (but a replayable one's), and one
that is parked has its return route updated (a client that reconnected still
gets the answer). A request refused by its handler (bad input, a bound) changed
nothing: its answer is not kept, and a retry is judged again.

Nothing a peer sends grows memory without bound. The reply cache and the
parked requests are bounded (bus/kept_requests.py): past the parking bounds, a
request of a type that parks (its handler has returned `DEFERRED` before) is
refused with `too_many_parked`. Large buffers are mapped on their own rather
than carved from the heap (bus/heap.py), and after a
burst of traffic the idle loop hands the memory that was freed back to the
system: glibc keeps it otherwise, and the process would stay at its peak.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

import structlog
import zmq

from elastic_control_plane.bus import health, metrics
from elastic_control_plane.bus.envelope import Message, WireError, decode, encode, error_body, reply_to
from elastic_control_plane.bus.heap import keep_large_buffers_out_of_the_heap, release_freed_memory
from elastic_control_plane.bus.kept_requests import ParkingLot, ReplyCache
from elastic_control_plane.bus.roles import ANY_ROLE, CallerRoles
from elastic_control_plane.bus.sockets import Security, server_socket, stop_authenticator

DEFERRED = object()
# Messages handled in one turn of the loop before its timers get theirs: a few tens of milliseconds of work.
MESSAGES_PER_TURN = 256
# After this many bytes through a service's sockets, the loop returns freed memory to the system when next idle: a
# release costs under a millisecond, ordinary traffic (heartbeats, rounds) needs minutes to move 1 MiB, and what a
# burst leaves after the last release is about this much.
RELEASE_AFTER_BYTES = 1024 * 1024


class RequestError(Exception):
    """Raised by a handler to answer with `{"error": code, "message": message}`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def field(body: dict[str, Any], name: str, kind: type) -> Any:
    """A required field of a request body, of the given type, or a `bad_request` error."""
    value = body.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise RequestError("bad_request", f"field {name!r} must be a {kind.__name__}")
    return value


def handles(msg_type: str, roles: Collection[str] = ANY_ROLE, replayable: bool = False) -> Callable[..., Any]:
    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn._handles = msg_type  # type: ignore[attr-defined]
        fn._roles = roles if roles is ANY_ROLE else frozenset(roles)  # type: ignore[attr-defined]
        fn._replayable = replayable  # type: ignore[attr-defined]
        return fn

    return mark


class LimitExceeded(RequestError):
    """A peer reached one of the service's bounds: refused like any `RequestError`, and logged as a warning."""


class Request:
    """A decoded request, the way back to its sender, and the size of its message in bytes."""

    def __init__(
        self,
        service: Service,
        msg: Message,
        route: bytes,
        key: tuple[str, str] | None,
        size: int,
        owner: str | None = None,
    ) -> None:
        self.msg = msg
        self.route = route
        self.key = key
        self.size = size
        self.owner = owner if owner is not None else self.parking_key[0]  # whose share of the parking lot it takes
        self._service = service
        self.answered = False

    @property
    def parking_key(self) -> tuple[str, str]:
        """Where a parked request is kept: its (sender, id), or its identity when it has none."""
        return self.key or ("", str(id(self)))

    @property
    def body(self) -> dict[str, Any]:
        return self.msg.body

    def reply(self, body: dict[str, Any] | None = None, raw: tuple[bytes, ...] = ()) -> None:
        self._service._answer(self, body or {}, raw)

    def fail(self, code: str, message: str) -> None:
        self._service._answer(self, error_body(code, message), ())

    def refuse(self, code: str, message: str) -> None:
        """Fail a request that changed nothing: its answer is not kept, a retry is judged again."""
        self._service._answer(self, error_body(code, message), (), cache=False)


class Service:
    """Base of the four services and the agent: owns the context, the ROUTER and the poll loop."""

    name = "service"

    def __init__(
        self,
        endpoint: str,
        *,
        security: Security = Security(),
        clock: Callable[[], float] = time.monotonic,
        log: structlog.stdlib.BoundLogger | None = None,
    ) -> None:
        keep_large_buffers_out_of_the_heap()
        self.ctx = zmq.Context()
        self.security = security
        self.clock = clock
        self.endpoint = endpoint
        self.log = log or structlog.get_logger().bind(process=self.name)
        self.router = server_socket(self.ctx, zmq.ROUTER, endpoint, security)
        self.sender_id = self.name
        self._handlers: dict[str, Callable[[Request], Any]] = {}
        self._roles: dict[str, Collection[str]] = {}
        self._replayable: set[str] = set()  # types whose answers are not kept: a retry runs the handler again
        for attr in dir(type(self)):
            fn = getattr(type(self), attr, None)
            msg_type = getattr(fn, "_handles", None)
            if msg_type:
                self._handlers[msg_type] = getattr(self, attr)
                self._roles[msg_type] = fn._roles  # type: ignore[union-attr]
                if fn._replayable:  # type: ignore[union-attr]
                    self._replayable.add(msg_type)
        self._callers = CallerRoles(security.keys_dir)
        if security.keys_dir is not None and endpoint.startswith("tcp://") and self._callers.single_key:
            self.log.warning(
                "keys_without_roles", keys=str(security.keys_dir), effect="the operator's key may call every handler"
            )
        self._sockets: dict[zmq.Socket, Callable[[], None]] = {self.router: self._on_router}
        self._timers: list[list[Any]] = []
        self._replied = ReplyCache()
        self._parked: ParkingLot[Request] = ParkingLot()
        self._parking_types: set[str] = set()
        self._traffic_bytes = 0
        self._stopping = threading.Event()
        # Asked before every turn of the loop: a replica that lost its role (replication/election.py) stops before it
        # handles anything more.
        self.may_serve: Callable[[], bool] = lambda: True
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)

    # -- loop plumbing -------------------------------------------------------------------------
    def every(self, interval: float, fn: Callable[[], None]) -> None:
        self._timers.append([time.monotonic() + interval, interval, fn])

    def watch(self, sock: Any, on_readable: Callable[[], None]) -> None:
        self._sockets[sock] = on_readable
        self.poller.register(sock, zmq.POLLIN)

    def unwatch(self, sock: Any) -> None:
        self._sockets.pop(sock, None)
        self.poller.unregister(sock)

    def stop(self) -> None:
        self._stopping.set()

    def serve_forever(self) -> None:
        """Run until SIGTERM/SIGINT, then close cleanly."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        signal.signal(signal.SIGINT, lambda *_: self.stop())
        self.log.info("serving", endpoint=self.endpoint)
        try:
            self.run()
        finally:
            self.close()
            self.log.info("stopped")

    def run(self) -> None:
        try:
            self._loop()
        finally:
            health.loop_stopped()  # a replica that steps down and stands by again is not a stuck one

    def _loop(self) -> None:
        while not self._stopping.is_set():
            health.loop_turned()
            now = time.monotonic()
            due = min((t[0] for t in self._timers), default=now + 0.5)
            timeout_ms = max(0, min(500, int((due - now) * 1000)))
            ready = dict(self.poller.poll(timeout_ms))
            if not self.may_serve():
                self.stop()
                return
            if not ready and self._traffic_bytes >= RELEASE_AFTER_BYTES:
                self._traffic_bytes = 0
                release_freed_memory()
            for sock, callback in list(self._sockets.items()):
                if sock in ready:
                    self._guarded(callback)
            now = time.monotonic()
            for timer in self._timers:
                if timer[0] <= now:
                    timer[0] = now + timer[1]
                    self._guarded(timer[2])

    def count_traffic(self, nbytes: int) -> None:
        """Note bytes received or sent on a socket: after `RELEASE_AFTER_BYTES`, the idle loop releases freed memory."""
        self._traffic_bytes += nbytes

    def _guarded(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            self.log.exception("loop_callback_failed", callback=getattr(fn, "__name__", repr(fn)))

    def close(self) -> None:
        for sock in list(self._sockets):
            if isinstance(sock, zmq.Socket):
                sock.close(linger=0)
        stop_authenticator(self.ctx)
        self.ctx.term()

    # -- requests ------------------------------------------------------------------------------
    @handles("ping", replayable=True)
    def on_ping(self, request: Request) -> dict[str, Any]:
        return {"service": self.name}

    def _on_router(self) -> None:
        """Handle what the ROUTER holds, at most MESSAGES_PER_TURN: under a flood the loop's timers still run."""
        for _ in range(MESSAGES_PER_TURN):
            if not self.may_serve():
                return
            try:
                received = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            frames = [frame.bytes for frame in received]
            self.count_traffic(sum(len(f) for f in frames))
            self._dispatch(frames[0], frames[1:], _user_id(received[-1]))

    def _dispatch(self, route: bytes, payload: list[bytes], user_id: str | None = None) -> None:
        try:
            msg = decode(payload)
        except WireError as exc:
            metrics.count_message(self.name, metrics.UNKNOWN_TYPE, metrics.MALFORMED)
            self.log.warning("bad_message", code=exc.code, reason=exc.message, frames=len(payload))
            self._send(
                route,
                encode(
                    Message(type="error", body=error_body(exc.code, exc.message), reply=True, sender=self.sender_id)
                ),
            )
            return
        if msg.reply:
            self.log.warning("unexpected_reply", type=msg.type, sender=msg.sender)
            return
        roles = self._roles.get(msg.type, ANY_ROLE)
        if not self._callers.allows(user_id, roles):
            role = self._callers.role_of(user_id) or "unknown"
            why = f"{self.name} answers {msg.type!r} only to the {' or '.join(sorted(roles))} role, not to {role}"
            self._forbid(route, msg, why, role=role, allowed=sorted(roles))
            return
        bound = self._callers.host_of(user_id)
        if bound is not None and isinstance(msg.body, dict) and msg.body.get("host", bound) != bound:
            named = msg.body.get("host")
            why = f"the key of host {bound!r} speaks only for that host, not for {named!r}"
            self._forbid(route, msg, why, role="agent", key_host=bound, named_host=str(named))
            return
        # Replies are kept and found by the caller's authenticated key with its sender name and the id: a caller with
        # another key that names the same sender and id reaches neither the reply nor the parked request. A host's own
        # key is one owner in the parking lot whatever sender names it uses; a shared key's share is per sender.
        caller = f"{user_id}/{msg.sender}" if user_id is not None else msg.sender
        key = (caller, msg.id) if msg.sender and msg.id else None
        cached = self._replied.get(key) if key is not None else None
        if cached is not None:
            self._send(route, cached)
            return
        parked = self._parked.get(key) if key is not None else None
        if parked is not None:
            parked.route = route
            return
        handler = self._handlers.get(msg.type)
        request = Request(self, msg, route, key, sum(len(f) for f in payload), user_id if bound is not None else None)
        if handler is None:
            metrics.count_message(self.name, metrics.UNKNOWN_TYPE, metrics.REFUSED)
            self.log.warning("unknown_type", type=msg.type, sender=msg.sender)
            request.refuse("unknown_type", f"{self.name} does not handle message type {msg.type!r}")
            return
        try:
            if msg.type in self._parking_types:
                self._check_room_to_park(request)
            result = handler(request)
        except RequestError as exc:
            metrics.count_message(self.name, msg.type, metrics.REFUSED)
            log = self.log.warning if isinstance(exc, LimitExceeded) else self.log.info
            log("request_refused", type=msg.type, code=exc.code, reason=exc.message, sender=msg.sender)
            request.refuse(exc.code, exc.message)
            return
        except Exception as exc:
            metrics.count_message(self.name, msg.type, metrics.FAILED)
            self.log.exception("handler_failed", type=msg.type, sender=msg.sender)
            request.fail("internal", f"{self.name} failed on {msg.type}: {type(exc).__name__}: {exc}")
            return
        metrics.count_message(self.name, msg.type, metrics.HANDLED)
        if result is DEFERRED:
            if not request.answered:
                self._park(request)
        elif not request.answered:
            request.reply(result)

    def _forbid(self, route: bytes, msg: Message, why: str, **who: Any) -> None:
        """A caller this handler does not answer (its role, or a host its key does not speak for): `forbidden`, and
        one log line naming the handler and `who`."""
        metrics.count_message(self.name, msg.type, metrics.REFUSED)
        self.log.warning("forbidden", handler=msg.type, sender=msg.sender, **who)
        self._send(route, encode(reply_to(msg, error_body("forbidden", why), self.sender_id)))

    def _check_room_to_park(self, request: Request) -> None:
        """Refuse a request of a type that parks when its sender, or the service, has the most parked already."""
        refusal = self._parked.refusal(request.owner, request.size)
        if refusal is not None:
            raise LimitExceeded("too_many_parked", refusal)

    def _park(self, request: Request) -> None:
        """Park a request its handler deferred, or refuse it past a bound: requests of types known to park are checked
        before their handler runs, this catches the first of a type."""
        self._parking_types.add(request.msg.type)
        try:
            self._check_room_to_park(request)
        except LimitExceeded as exc:
            self.log.warning(
                "request_refused", type=request.msg.type, code=exc.code, reason=exc.message, sender=request.msg.sender
            )
            request.fail(exc.code, exc.message)
            return
        self._parked.park(request.parking_key, request)

    def _answer(self, request: Request, body: dict[str, Any], raw: tuple[bytes, ...], cache: bool = True) -> None:
        if request.answered:
            return
        request.answered = True
        self._parked.unpark(request.parking_key)
        frames = encode(reply_to(request.msg, body, self.sender_id, raw))
        if request.key is not None and cache and request.msg.type not in self._replayable:
            self._replied.put(request.key, frames)
        self._send(request.route, frames)

    def _send(self, route: bytes, frames: list[bytes]) -> None:
        self.count_traffic(sum(len(f) for f in frames))
        try:
            self.router.send_multipart([route, *frames], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.log.info("reply_undeliverable", reason=str(exc))

    def push(self, route: bytes, msg: Message) -> None:
        """Send an unsolicited message to a connected peer (used by the agent to reach its workers)."""
        self._send(route, encode(msg))


def _user_id(frame: zmq.Frame) -> str | None:
    """The key a caller authenticated with over CURVE (its ZAP User-Id); None on a socket without CURVE."""
    try:
        return frame.get("User-Id")  # type: ignore[no-any-return]
    except zmq.ZMQError:
        return None
