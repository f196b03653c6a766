"""NotifierService: takes `publish` requests from services, stamps a sequence number, fans out on XPUB.

Stamps each event with the time it was published (`time`, wall-clock seconds).
Keeps a bounded history so a late or reconnecting subscriber can ask `since`
for what it missed, and publishes a heartbeat carrying the latest sequence
number so a subscriber notices a gap even when no new event follows it.

Bounds: an event larger than `MAX_EVENT_BYTES` is refused (`too_large`); the
history keeps at most `HISTORY` events and `HISTORY_BYTES` of them, oldest
dropped first. A peer that sends the events socket a frame larger than
`EVENTS_MAX_FRAME_BYTES` is dropped by libzmq; anything a peer sends that is
not a subscription (an XSUB may send frames upstream) is read and dropped.
libzmq keeps every topic a peer subscribes to for as long as the peer stays
connected (XPUB_MANUAL does not help: it keeps them too), so once topics no
subscriber of ours uses add up to `MAX_FOREIGN_SUBSCRIPTION_BYTES`, the socket
is closed and bound again: every peer is disconnected and its topics freed;
subscribers reconnect, subscribe again and fill the gap from the history.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Any

import zmq

from bus.pubsub import EVENT_TOPIC, HEARTBEAT, event_frames
from bus.service import LimitExceeded, Request, RequestError, Service, handles
from bus.sockets import Security, server_socket, stop_authenticator

# A subscriber away for a while catches up from here with one `since` request.
HISTORY = 4096
# ...and that reply must stay well under MAX_MESSAGE_BYTES: 4096 ordinary events (under 1 KiB each), or a few of
# the largest `round` events.
HISTORY_BYTES = 4 * 1024 * 1024
# The largest event is `round`: every slot (about 150 bytes each) with the job's command and environment, so 1 MiB
# holds a round of several thousand slots.
MAX_EVENT_BYTES = 1024 * 1024
# The topics subscribers use: `bus.sockets.client_socket` subscribes a SUB socket to everything (b""), and every
# event is sent under EVENT_TOPIC.
SUBSCRIBABLE_TOPICS = frozenset({b"", EVENT_TOPIC})
# A subscriber's largest frame is its CURVE handshake (INITIATE, ~300 bytes); a subscription to EVENT_TOPIC is 15.
EVENTS_MAX_FRAME_BYTES = 1024
# libzmq keeps a topic in a trie at ~50 bytes per byte of topic, so 64 KiB of foreign topics hold ~3 MiB; our
# subscribers never send one.
MAX_FOREIGN_SUBSCRIPTION_BYTES = 64 * 1024
SUBSCRIPTION = b"\x01"  # what libzmq puts before the topic of a subscription it hands up


class History:
    """The latest events as (type, body, encoded size); past `events` events or `max_bytes` bytes the oldest go."""

    def __init__(self, events: int = HISTORY, max_bytes: int = HISTORY_BYTES) -> None:
        self.events = events
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._kept: deque[tuple[str, dict[str, Any], int]] = deque()

    def __len__(self) -> int:
        return len(self._kept)

    def append(self, event: str, body: dict[str, Any], size: int) -> None:
        self._kept.append((event, body, size))
        self.nbytes += size
        while len(self._kept) > self.events or self.nbytes > self.max_bytes:
            self.nbytes -= self._kept.popleft()[2]

    def since(self, seq: int) -> list[list[Any]]:
        """The kept events numbered after `seq`, oldest first, as [type, body] pairs."""
        return [[event, body] for event, body, _ in self._kept if body["seq"] > seq]


class NotifierService(Service):
    name = "notifier"

    def __init__(
        self, endpoint: str, events_endpoint: str, *, heartbeat: float = 1.0, security: Security = Security(), **kw: Any
    ) -> None:
        super().__init__(endpoint, security=security, **kw)
        self.incarnation = uuid.uuid4().hex
        self.seq = 0
        self.history = History()
        self.events_endpoint = events_endpoint
        self.events_ctx = zmq.Context()  # its own, so that closing it (term) frees the endpoint before binding again
        self.events = self._bind_events()
        self.foreign_subscription_bytes = 0
        self.every(heartbeat, self._heartbeat)

    def _bind_events(self) -> zmq.Socket:
        sock = server_socket(
            self.events_ctx,
            zmq.XPUB,
            self.events_endpoint,
            self.security,
            options={zmq.MAXMSGSIZE: EVENTS_MAX_FRAME_BYTES},
        )
        self.watch(sock, self._on_subscription)
        return sock

    def _rebind_events(self) -> None:
        """Close the events socket and bind a new one: every peer is disconnected, and libzmq frees its topics."""
        reason = f"subscriptions to topics no subscriber uses passed {MAX_FOREIGN_SUBSCRIPTION_BYTES} bytes"
        self.log.warning("events_socket_rebound", reason=reason)
        self.unwatch(self.events)
        self.events.close(linger=0)
        stop_authenticator(self.events_ctx)
        self.events_ctx.term()
        self.events_ctx = zmq.Context()
        self.events = self._bind_events()
        self.foreign_subscription_bytes = 0

    def _on_subscription(self) -> None:
        """Add up subscriptions to topics no subscriber uses; drop anything else a peer sent into the socket."""
        while True:
            try:
                frame = self.events.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.count_traffic(len(frame))
            if frame[:1] == SUBSCRIPTION and frame[1:] not in SUBSCRIBABLE_TOPICS:
                self.foreign_subscription_bytes += len(frame)
        if self.foreign_subscription_bytes > MAX_FOREIGN_SUBSCRIPTION_BYTES:
            self._rebind_events()

    def _heartbeat(self) -> None:
        self.events.send_multipart(
            event_frames(HEARTBEAT, {"seq": self.seq, "incarnation": self.incarnation}, self.name)
        )

    @handles("publish")
    def on_publish(self, request: Request) -> dict[str, Any]:
        event, data = request.body.get("event"), request.body.get("data", {})
        if not isinstance(event, str) or not event or not isinstance(data, dict):
            raise RequestError("bad_request", "publish needs 'event' (string) and 'data' (map)")
        body = {**data, "seq": self.seq + 1, "incarnation": self.incarnation, "time": time.time()}
        frames = event_frames(event, body, self.name)
        size = sum(len(f) for f in frames)
        if size > MAX_EVENT_BYTES:
            raise LimitExceeded(
                "too_large", f"event {event[:64]!r} of {size} bytes exceeds the notifier's {MAX_EVENT_BYTES}"
            )
        self.seq += 1
        self.history.append(event, body, size)
        self.events.send_multipart(frames)
        self.count_traffic(size)
        self.log.info("published", event_type=event, seq=self.seq, sender=request.msg.sender)
        return {"seq": self.seq}

    @handles("since")
    def on_since(self, request: Request) -> dict[str, Any]:
        seq = request.body.get("seq", -1)
        if not isinstance(seq, int):
            raise RequestError("bad_request", "since needs an integer 'seq'")
        if request.body.get("incarnation") not in (None, self.incarnation):
            seq = 0
        events = self.history.since(seq) if seq >= 0 else []
        return {"incarnation": self.incarnation, "latest": self.seq, "events": events}

    def close(self) -> None:
        super().close()
        stop_authenticator(self.events_ctx)
        self.events_ctx.term()
