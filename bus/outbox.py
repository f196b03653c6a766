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
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

from elastic_control_plane.bus.client import AsyncClient
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.sockets import Security

MAX_QUEUED = 10_000  # hours of events at a normal rate; a notifier away that long is an outage the operator sees
RESEND_EVERY = 1.0

Event = tuple[str, dict[str, Any]]


class Outbox:
    def __init__(self, service: Any, endpoint: str, sender: str, security: Security = Security()) -> None:
        self._service = service
        self._client = AsyncClient(service, endpoint, sender, security)
        self.queued: deque[Event] = deque()
        self._sending: Event | None = None
        self._refusal_said = False  # the head's temporary refusal was logged

    def restore(self, events: Iterable[Event]) -> None:
        """The queue becomes `events` (what was saved: the events queued since are forgotten); the event on its way,
        if it heads them, stays the one on its way (its answer takes it off, never a copy of it)."""
        self.queued = deque(events)
        if self._sending is not None and self.queued and self.queued[0] == self._sending:
            self.queued[0] = self._sending

    def put(self, event: str, data: dict[str, Any]) -> None:
        self.queued.append((event, data))
        if len(self.queued) > MAX_QUEUED:
            dropped, _ = self.queued.popleft()
            self._service.log.warning(
                "event_dropped", event_type=dropped, reason=f"more than {MAX_QUEUED} events wait for the notifier"
            )

    def flush(self) -> None:
        """Send the head of the queue unless it is already on its way."""
        if self._sending is not None or not self.queued:
            return
        head = self._sending = self.queued[0]
        self._client.send(
            "publish",
            {"event": head[0], "data": head[1]},
            on_reply=lambda reply: self._on_reply(head, reply),
            timeout=RESEND_EVERY,
            deadline=None,
            retry_refused=lambda refusal: self._on_refused(head, refusal),
        )
        self._refusal_said = False

    def _on_refused(self, sent: Event, refusal: Message) -> None:
        if not self._refusal_said:
            self._refusal_said = True
            self._service.log.warning(
                "event_delayed",
                event_type=sent[0],
                reason=refusal.body.get("message", refusal.error),
                queued=len(self.queued),
            )

    def _on_reply(self, sent: Event, reply: Message) -> None:
        self._sending = None
        if self.queued and self.queued[0] is sent:
            self.queued.popleft()
        if reply.error is not None:
            self._service.log.warning(
                "event_refused", event_type=sent[0], reason=reply.body.get("message", reply.error)
            )
        self.flush()
