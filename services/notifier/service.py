"""NotifierService: takes `publish` requests from services, stamps a sequence number, fans out on XPUB.

Keeps a bounded history so a late or reconnecting subscriber can ask `since`
for what it missed, and publishes a heartbeat carrying the latest sequence
number so a subscriber notices a gap even when no new event follows it.
"""

from __future__ import annotations

import uuid
from collections import deque
from typing import Any

import zmq

from bus.pubsub import HEARTBEAT, event_frames
from bus.service import Request, RequestError, Service, handles
from bus.sockets import Security, server_socket

HISTORY = 4096


class NotifierService(Service):
    name = "notifier"

    def __init__(self, endpoint: str, events_endpoint: str, *, heartbeat: float = 1.0, security: Security = Security(), **kw: Any) -> None:
        super().__init__(endpoint, security=security, **kw)
        self.incarnation = uuid.uuid4().hex
        self.seq = 0
        self.history: deque[tuple[str, dict[str, Any]]] = deque(maxlen=HISTORY)
        self.events = server_socket(self.ctx, zmq.XPUB, events_endpoint, security)
        self.watch(self.events, self._on_subscription)
        self.every(heartbeat, self._heartbeat)

    def _on_subscription(self) -> None:
        while True:
            try:
                self.events.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _heartbeat(self) -> None:
        self.events.send_multipart(event_frames(HEARTBEAT, {"seq": self.seq, "incarnation": self.incarnation}, self.name))

    @handles("publish")
    def on_publish(self, request: Request) -> dict[str, Any]:
        event, data = request.body.get("event"), request.body.get("data", {})
        if not isinstance(event, str) or not event or not isinstance(data, dict):
            raise RequestError("bad_request", "publish needs 'event' (string) and 'data' (map)")
        self.seq += 1
        body = {**data, "seq": self.seq, "incarnation": self.incarnation}
        self.history.append((event, body))
        self.events.send_multipart(event_frames(event, body, self.name))
        self.log.info("published", event_type=event, seq=self.seq, sender=request.msg.sender)
        return {"seq": self.seq}

    @handles("since")
    def on_since(self, request: Request) -> dict[str, Any]:
        seq = request.body.get("seq", -1)
        if not isinstance(seq, int):
            raise RequestError("bad_request", "since needs an integer 'seq'")
        if request.body.get("incarnation") not in (None, self.incarnation):
            seq = 0
        events = [[event, body] for event, body in self.history if body["seq"] > seq] if seq >= 0 else []
        return {"incarnation": self.incarnation, "latest": self.seq, "events": events}
