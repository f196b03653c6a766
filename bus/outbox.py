"""Outbox: a service's events for the notifier, published in order, one at a time, until the notifier takes each.

A service queues an event with `put` and sends what is queued with `flush`
(the registry saves its state in between, so no event goes out about a
change it could forget). The head is resent every second until the notifier
answers: an event queued while the notifier is away goes out once it is back,
after the ones before it. A temporary refusal (`unavailable`: the notifier
could not write it to etcd, or is failing over) keeps it at the head, tried
again with a backoff (bus/client.py's TEMPORARY_REFUSALS), said once per
event; only a permanent refusal (too large, a bad request) drops it, logged,
so it cannot block the ones after it. The queue holds at most `MAX_QUEUED`
events; beyond that the oldest is dropped with a warning.

Exactly once: each event gets a key when it is queued (`put`), kept with it
wherever it is saved, and sent with every try; the notifier publishes a key
once and answers a repeat with the first one's number. So neither an answer
lost on the way (the head sent again), a notifier failover, nor a registry
that restarts and sends its saved queue again publishes an event twice.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any, NamedTuple

from elastic_control_plane.bus.client import AsyncClient
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.sockets import Security

MAX_QUEUED = 10_000  # hours of events at a normal rate; a notifier away that long is an outage the operator sees
RESEND_EVERY = 1.0


class QueuedEvent(NamedTuple):
    """An event waiting for the notifier: its type, its data, and the key the notifier publishes it once by."""

    type: str
    data: dict[str, Any]
    key: str

    @classmethod
    def saved(cls, item: list[Any]) -> QueuedEvent:
        """An event as `list(event)` saved it (one saved before keys were kept gets one now)."""
        return cls(item[0], item[1], item[2] if len(item) > 2 else uuid.uuid4().hex)


class Outbox:
    def __init__(self, service: Any, endpoint: str, sender: str, security: Security = Security()) -> None:
        self._service = service
        self._client = AsyncClient(service, endpoint, sender, security)
        self.queued: deque[QueuedEvent] = deque()
        self._sending: QueuedEvent | None = None
        self._refusal_said = False  # the head's temporary refusal was logged

    def restore(self, events: Iterable[QueuedEvent]) -> None:
        """The queue becomes `events` (what was saved: the events queued since are forgotten); the event on its way,
        if it heads them, stays the one on its way (its answer takes it off, never a copy of it)."""
        self.queued = deque(events)
        if self._sending is not None and self.queued and self.queued[0].key == self._sending.key:
            self.queued[0] = self._sending

    def put(self, event: str, data: dict[str, Any]) -> None:
        self.queued.append(QueuedEvent(event, data, uuid.uuid4().hex))
        if len(self.queued) > MAX_QUEUED:
            dropped = self.queued.popleft()
            self._service.log.warning(
                "event_dropped", event_type=dropped.type, reason=f"more than {MAX_QUEUED} events wait for the notifier"
            )

    def flush(self) -> None:
        """Send the head of the queue unless it is already on its way."""
        if self._sending is not None or not self.queued:
            return
        head = self._sending = self.queued[0]
        self._client.send(
            "publish",
            {"event": head.type, "data": head.data, "key": head.key},
            on_reply=lambda reply: self._on_reply(head, reply),
            timeout=RESEND_EVERY,
            deadline=None,
            retry_refused=lambda refusal: self._on_refused(head, refusal),
        )
        self._refusal_said = False

    def _on_refused(self, sent: QueuedEvent, refusal: Message) -> None:
        if not self._refusal_said:
            self._refusal_said = True
            self._service.log.warning(
                "event_delayed",
                event_type=sent.type,
                reason=refusal.body.get("message", refusal.error),
                queued=len(self.queued),
            )

    def _on_reply(self, sent: QueuedEvent, reply: Message) -> None:
        self._sending = None
        if self.queued and self.queued[0] is sent:
            self.queued.popleft()
        if reply.error is not None:
            self._service.log.warning(
                "event_refused", event_type=sent.type, reason=reply.body.get("message", reply.error)
            )
        self.flush()
