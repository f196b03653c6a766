"""Sequenced publish/subscribe (the zguide's Clone pattern): no event is lost to a late or reconnecting subscriber.

The notifier publishes through a `Publisher` and stamps each event with `seq` (1, 2, ...) and its `incarnation`.
A `Subscription` subscribes first, then learns the latest sequence number;
afterwards it delivers events in order, exactly once: duplicates (seq <= last)
are dropped, and a gap (seen from an event or from the notifier's heartbeat)
is filled from the notifier's bounded history before anything newer is
delivered; while the notifier does not answer (a failover), nothing newer is
delivered, and the next event or heartbeat tries again. A new notifier incarnation restarts the count from its history.

A `Publisher` is an XPUB socket in a zmq context of its own. A peer that sends it a frame larger than
`EVENTS_MAX_FRAME_BYTES` is dropped by libzmq; anything a peer sends that is not a subscription (an XSUB may send
frames upstream) is read and dropped. libzmq keeps every topic a peer subscribes to for as long as the peer stays
connected (XPUB_MANUAL does not help: it keeps them too), so once topics no subscriber of ours uses add up to
`max_foreign_subscription_bytes`, the publisher is to be bound again (`rebind`): the socket and its context are
closed, which disconnects every peer, frees its topics and the endpoint; subscribers reconnect, subscribe again and
fill the gap from the notifier's history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from elastic_control_plane.bus.client import Client, ServiceError, Unreachable
from elastic_control_plane.bus.envelope import Message, WireError, decode, encode
from elastic_control_plane.bus.sockets import Security, client_socket, server_socket, stop_authenticator

EVENT_TOPIC = b"event"
HEARTBEAT = "notifier.heartbeat"
# The topics subscribers use: `bus.sockets.client_socket` subscribes a SUB socket to everything (b""), and every
# event is sent under EVENT_TOPIC.
SUBSCRIBABLE_TOPICS = frozenset({b"", EVENT_TOPIC})
# A subscriber's largest frame is its CURVE handshake (INITIATE, ~300 bytes); a subscription to EVENT_TOPIC is 15.
EVENTS_MAX_FRAME_BYTES = 1024
# libzmq keeps a topic in a trie at ~50 bytes per byte of topic, so 64 KiB of foreign topics hold ~3 MiB; our
# subscribers never send one.
MAX_FOREIGN_SUBSCRIPTION_BYTES = 64 * 1024
SUBSCRIPTION = b"\x01"  # what libzmq puts before the topic of a subscription it hands up


@dataclass(frozen=True)
class EncodedEvent:
    """An event as it is published: its frames and their size in bytes."""

    frames: list[bytes]
    nbytes: int


def encode_event(event_type: str, body: dict[str, Any], sender: str) -> EncodedEvent:
    frames = [EVENT_TOPIC, *encode(Message(type=event_type, body=body, sender=sender))]
    return EncodedEvent(frames, sum(len(frame) for frame in frames))


class Publisher:
    """The events socket (XPUB) bound at `endpoint`: sends events, reads and counts what peers send it."""

    def __init__(
        self,
        endpoint: str,
        security: Security = Security(),
        max_foreign_subscription_bytes: int = MAX_FOREIGN_SUBSCRIPTION_BYTES,
    ) -> None:
        self.endpoint, self.security = endpoint, security
        self.max_foreign_subscription_bytes = max_foreign_subscription_bytes
        self.foreign_subscription_bytes = 0
        self.ctx, self.sock = self._bind()

    def _bind(self) -> tuple[zmq.Context, zmq.Socket]:
        ctx = zmq.Context()  # its own, so that closing it (term) frees the endpoint before binding again
        options = {zmq.MAXMSGSIZE: EVENTS_MAX_FRAME_BYTES}
        return ctx, server_socket(ctx, zmq.XPUB, self.endpoint, self.security, options=options)

    def send(self, event: EncodedEvent) -> None:
        self.sock.send_multipart(event.frames)

    def receive(self) -> int:
        """Read everything peers sent (subscriptions, or anything else, dropped); the bytes read. Subscriptions to
        topics no subscriber uses are added up."""
        nbytes = 0
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return nbytes
            nbytes += len(frame)
            if frame[:1] == SUBSCRIPTION and frame[1:] not in SUBSCRIBABLE_TOPICS:
                self.foreign_subscription_bytes += len(frame)

    def holds_too_many_foreign_topics(self) -> bool:
        return self.foreign_subscription_bytes > self.max_foreign_subscription_bytes

    def rebind(self) -> None:
        """Close the socket and bind a new one: every peer is disconnected, and libzmq frees its topics."""
        self.close()
        self.ctx, self.sock = self._bind()
        self.foreign_subscription_bytes = 0

    def close(self) -> None:
        self.sock.close(linger=0)
        stop_authenticator(self.ctx)
        self.ctx.term()


class Subscription:
    """Ordered, gap-free delivery of the notifier's events to one subscriber."""

    def __init__(
        self,
        ctx: zmq.Context,
        events_endpoint: str,
        notifier_endpoint: str,
        sender: str,
        security: Security = Security(),
    ) -> None:
        self.sock = client_socket(ctx, zmq.SUB, events_endpoint, security)
        self._catchup = Client(notifier_endpoint, sender, security=security, timeout=1.0, deadline=1.0, ctx=ctx)
        self.last_seq: int | None = None
        self.incarnation: str | None = None

    def start(self) -> None:
        """Learn the latest sequence number, so only events after now are delivered."""
        try:
            reply = self._catchup.request("since", {"seq": -1})
        except (Unreachable, ServiceError):
            return
        self.incarnation = reply.body["incarnation"]
        self.last_seq = int(reply.body["latest"])

    def receive(self) -> list[Message]:
        """Drain the socket; return new events in sequence order."""
        delivered: list[Message] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return delivered
            try:
                msg = decode(frames[1:])
            except WireError:
                continue
            delivered.extend(self._accept(msg))

    def _accept(self, msg: Message) -> list[Message]:
        seq, incarnation = msg.body.get("seq"), msg.body.get("incarnation")
        if not isinstance(seq, int) or not isinstance(incarnation, str):
            return []
        if incarnation != self.incarnation:
            restarted = self.incarnation is not None
            self.incarnation = incarnation
            self.last_seq = 0 if restarted or self.last_seq is not None else (seq if msg.type == HEARTBEAT else seq - 1)
        assert self.last_seq is not None
        if msg.type == HEARTBEAT:
            return self._fill_gap() if seq > self.last_seq else []
        if seq <= self.last_seq:
            return []
        missed = self._fill_gap() if seq > self.last_seq + 1 else []
        if self.last_seq >= seq or self.last_seq + 1 < seq:
            return missed  # the history held it; or the gap is still open: the next event or heartbeat fills it
        self.last_seq = seq
        return [*missed, msg]

    def _fill_gap(self) -> list[Message]:
        try:
            reply = self._catchup.request("since", {"seq": self.last_seq, "incarnation": self.incarnation})
        except (Unreachable, ServiceError):
            return []
        if reply.body.get("incarnation") != self.incarnation:
            return []
        missed = []
        for event_type, body in reply.body.get("events", []):
            if body["seq"] > (self.last_seq or 0):
                missed.append(Message(type=event_type, body=body))
                self.last_seq = body["seq"]
        return missed

    def close(self) -> None:
        self.sock.close(linger=0)
        self._catchup.close()
