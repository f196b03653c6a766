"""Sequenced publish/subscribe (the zguide's Clone pattern): no event is lost to a late or reconnecting subscriber.

The notifier stamps each event with `seq` (1, 2, ...) and its `incarnation`.
A `Subscription` subscribes first, then learns the latest sequence number;
afterwards it delivers events in order, exactly once: duplicates (seq <= last)
are dropped, and a gap (seen from an event or from the notifier's heartbeat)
is filled from the notifier's bounded history before anything newer is
delivered. A new notifier incarnation restarts the count from its history.
"""

from __future__ import annotations

from typing import Any

import zmq

from bus.client import Client, ServiceError, Unreachable
from bus.envelope import Message, WireError, decode, encode
from bus.sockets import Security, client_socket

EVENT_TOPIC = b"event"
HEARTBEAT = "notifier.heartbeat"


def event_frames(event_type: str, body: dict[str, Any], sender: str) -> list[bytes]:
    return [EVENT_TOPIC, *encode(Message(type=event_type, body=body, sender=sender))]


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
        if self.last_seq >= seq:
            return missed
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
