"""NotifierService: takes `publish` requests from services, stamps a sequence number, fans out on XPUB.

Stamps each event with the time it was published (`time`, wall-clock seconds).
Keeps a bounded history so a late or reconnecting subscriber can ask `since`
for what it missed, and publishes a heartbeat carrying the latest sequence
number so a subscriber notices a gap even when no new event follows it.

Exactly once: a `publish` may carry a `key` (bus/outbox.py gives each event
one); the event keeps it as `publish_key`, and a key already among the kept
events is answered with that event's number and not published again. The
keys live in the history, so they are bounded by it, and a replica that takes
over knows them from the history it loads.

Bounds: an event larger than `MAX_EVENT_BYTES` is refused (`too_large`); the
history keeps at most `HISTORY` events and `HISTORY_BYTES` of them, oldest
dropped first. Replicated (`--store etcd://...`), the incarnation, the
sequence and the history are kept in etcd as well (services/notifier/event_log.py),
written before an event is sent: a replica that takes over goes on from them.
The events socket is a `bus.pubsub.Publisher`: once its peers'
subscriptions to topics no subscriber uses add up past its bound, it is bound
again (every peer disconnected and its topics freed); subscribers reconnect,
subscribe again and fill the gap from the history.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from typing import Any

from elastic_control_plane.bus.contract import PUBLISH_KEY
from elastic_control_plane.bus.pubsub import HEARTBEAT, Publisher, encode_event
from elastic_control_plane.bus.roles import SERVICE
from elastic_control_plane.bus.service import LimitExceeded, Request, RequestError, Service, handles
from elastic_control_plane.bus.sockets import Security
from elastic_control_plane.services.notifier.event_log import EventLog, EventLogError

# A subscriber away for a while catches up from here with one `since` request.
HISTORY = 4096
# ...and that reply must stay well under MAX_MESSAGE_BYTES: 4096 ordinary events (under 1 KiB each), or a few of
# the largest `round` events.
HISTORY_BYTES = 4 * 1024 * 1024
# The largest event is `round`: every slot (about 150 bytes each) with the job's command and environment, so 1 MiB
# holds a round of several thousand slots.
MAX_EVENT_BYTES = 1024 * 1024
# The longest publish key taken (an event keeps its key as bus/contract.py's PUBLISH_KEY).
MAX_PUBLISH_KEY_CHARS = 64


class History:
    """The latest events as (type, body, encoded size); past `events` events or `max_bytes` bytes the oldest go. The
    publish keys of the kept events, with their numbers."""

    def __init__(self, events: int = HISTORY, max_bytes: int = HISTORY_BYTES) -> None:
        self.events = events
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._kept: deque[tuple[str, dict[str, Any], int]] = deque()
        self._seq_by_key: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def append(self, event: str, body: dict[str, Any], size: int) -> None:
        self._kept.append((event, body, size))
        self.nbytes += size
        key = body.get(PUBLISH_KEY)
        if isinstance(key, str):
            self._seq_by_key[key] = body["seq"]
        while len(self._kept) > self.events or self.nbytes > self.max_bytes:
            _, dropped, dropped_size = self._kept.popleft()
            self.nbytes -= dropped_size
            self._seq_by_key.pop(dropped.get(PUBLISH_KEY), None)

    def published(self, key: str) -> int | None:
        """The number of the kept event published under `key`, if one is."""
        return self._seq_by_key.get(key)

    def dropped_by(self, size: int) -> list[int]:
        """The numbers of the events that keeping one more of `size` bytes would let go."""
        count, nbytes, dropped = len(self._kept) + 1, self.nbytes + size, []
        for _, body, kept_size in self._kept:
            if count <= self.events and nbytes <= self.max_bytes:
                break
            count, nbytes = count - 1, nbytes - kept_size
            dropped.append(body["seq"])
        return dropped

    def since(self, seq: int) -> list[list[Any]]:
        """The kept events numbered after `seq`, oldest first, as [type, body] pairs."""
        return [[event, body] for event, body, _ in self._kept if body["seq"] > seq]


class NotifierService(Service):
    name = "notifier"

    def __init__(
        self,
        endpoint: str,
        events_endpoint: str,
        *,
        heartbeat: float = 1.0,
        security: Security = Security(),
        event_log: EventLog | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(endpoint, security=security, **kw)
        self.event_log = event_log
        self.incarnation = uuid.uuid4().hex
        self.seq = 0
        self.history = History()
        if event_log is not None:
            self._take_over(event_log)
        self.events = Publisher(events_endpoint, security)
        self.watch(self.events.sock, self._on_subscription)
        self.every(heartbeat, self._heartbeat)

    def _take_over(self, event_log: EventLog) -> None:
        """Go on from the incarnation, number and history the last active replica left in etcd."""
        incarnation, seq, events = event_log.load()
        if incarnation is None:
            event_log.start(self.incarnation)
            return
        self.incarnation, self.seq = incarnation, seq
        for event, body in events:
            self.history.append(event, body, encode_event(event, body, self.name).nbytes)
        self.log.info("took_over", incarnation=incarnation, seq=seq, history=len(events))

    def _on_subscription(self) -> None:
        """Count what peers sent the events socket; bind it again once it holds too many foreign topics."""
        self.count_traffic(self.events.receive())
        if self.events.holds_too_many_foreign_topics():
            limit = self.events.max_foreign_subscription_bytes
            self.log.warning(
                "events_socket_rebound", reason=f"subscriptions to topics no subscriber uses passed {limit} bytes"
            )
            self.unwatch(self.events.sock)
            self.events.rebind()
            self.watch(self.events.sock, self._on_subscription)

    def _heartbeat(self) -> None:
        self.events.send(encode_event(HEARTBEAT, {"seq": self.seq, "incarnation": self.incarnation}, self.name))

    @handles("publish", roles=(SERVICE,))
    def on_publish(self, request: Request) -> dict[str, Any]:
        event, data, key = request.body.get("event"), request.body.get("data", {}), request.body.get("key")
        if not isinstance(event, str) or not event or not isinstance(data, dict):
            raise RequestError("bad_request", "publish needs 'event' (string) and 'data' (map)")
        if key is not None and not (isinstance(key, str) and 0 < len(key) <= MAX_PUBLISH_KEY_CHARS):
            raise RequestError("bad_request", f"a publish key is a string of 1 to {MAX_PUBLISH_KEY_CHARS} characters")
        if key is not None and (seq := self.history.published(key)) is not None:
            self.log.info("published_already", event_type=event, seq=seq, sender=request.msg.sender)
            return {"seq": seq, "published_already": True}
        body = {**data, "seq": self.seq + 1, "incarnation": self.incarnation, "time": time.time()}
        if key is not None:
            body[PUBLISH_KEY] = key
        encoded = encode_event(event, body, self.name)
        if encoded.nbytes > MAX_EVENT_BYTES:
            raise LimitExceeded(
                "too_large", f"event {event[:64]!r} of {encoded.nbytes} bytes exceeds the notifier's {MAX_EVENT_BYTES}"
            )
        if self.event_log is not None:
            try:
                self.event_log.append(self.incarnation, event, body, self.history.dropped_by(encoded.nbytes))
            except EventLogError as exc:
                raise RequestError("unavailable", str(exc)) from None
        self.seq += 1
        self.history.append(event, body, encoded.nbytes)
        self.events.send(encoded)
        self.count_traffic(encoded.nbytes)
        self.log.info("published", event_type=event, seq=self.seq, sender=request.msg.sender)
        return {"seq": self.seq}

    @handles("since", replayable=True)
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
        self.events.close()
