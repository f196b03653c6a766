"""A temporary refusal is not an answer (issue 45): a request sent with `retry_refused` goes again after a backoff
while the service answers `unavailable` (its store refused or is out of reach), and is answered once it is done; a
permanent refusal is answered at once. The outbox publishes every event in order exactly once through a notifier
that refuses some of them for a while, and drops only what the notifier refuses for good, saying so."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from elastic_control_plane.bus.client import AsyncClient
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.outbox import Outbox
from elastic_control_plane.bus.service import LimitExceeded, Request, RequestError, Service, handles
from testing.harness import free_ports, serve_in_thread, wait_for


class StoreThatBlinks(Service):
    """A notifier whose store refuses the next `refusals` writes: it answers them `unavailable`, as ours does when
    etcd refuses; it refuses an event named `huge` for good (`too_large`); what it took, it keeps in order."""

    name = "blinking-notifier"

    def __init__(self) -> None:
        super().__init__(f"tcp://127.0.0.1:{free_ports(1)[0]}")
        self.refusals = 0
        self.published: list[dict[str, Any]] = []
        self.ids: list[str] = []
        self.lock = threading.Lock()

    @handles("publish")
    def on_publish(self, request: Request) -> dict[str, Any]:
        with self.lock:
            self.ids.append(request.msg.id)
            if request.body["event"] == "huge":
                raise LimitExceeded("too_large", "an event over the limit")
            if self.refusals:
                self.refusals -= 1
                raise RequestError("unavailable", "etcd refused the write")
            self.published.append(request.body["data"])
            return {"seq": len(self.published)}


class Sender(Service):
    """A service that sends through an outbox and a retrying client, as the registry and the agents do."""

    name = "sender"

    def __init__(self, notifier: str) -> None:
        super().__init__(f"tcp://127.0.0.1:{free_ports(1)[0]}")
        self.outbox = Outbox(self, notifier, "sender-outbox")
        self.client = AsyncClient(self, notifier, "sender-client")
        self.replies: list[Message] = []
        self.refusals_seen: list[Message] = []
        self.asks: list[tuple[str, dict[str, Any]]] = []
        self.every(0.01, self._send_asked)

    def _send_asked(self) -> None:
        while self.asks:
            kind, data = self.asks.pop(0)
            if kind == "outbox":
                self.outbox.put(str(data["event"]), data)
                self.outbox.flush()
            else:
                self.client.send(
                    "publish",
                    {"event": kind, "data": data},
                    on_reply=self.replies.append,
                    timeout=1.0,
                    deadline=30.0,
                    retry_refused=self.refusals_seen.append,
                )


@pytest.fixture
def notifier() -> Iterator[StoreThatBlinks]:
    yield from serve_in_thread(StoreThatBlinks())  # type: ignore[misc]


@pytest.fixture
def sender(notifier: StoreThatBlinks) -> Iterator[Sender]:
    yield from serve_in_thread(Sender(notifier.endpoint))  # type: ignore[misc]


def test_a_request_refused_for_now_is_sent_again_and_answered_once_done(
    notifier: StoreThatBlinks, sender: Sender
) -> None:
    notifier.refusals = 3
    sender.asks.append(("report", {"pid": 7}))
    (reply,) = wait_for(lambda: sender.replies, 10, "the reply")
    assert reply.error is None and reply.body == {"seq": 1}
    assert [refusal.error for refusal in sender.refusals_seen] == ["unavailable"] * 3
    assert len(set(notifier.ids)) == 4, "each try is a new request: the service keeps its refusal under the old id"
    assert notifier.published == [{"pid": 7}]


def test_a_permanent_refusal_is_answered_at_once(notifier: StoreThatBlinks, sender: Sender) -> None:
    sender.asks.append(("huge", {"pid": 7}))
    (reply,) = wait_for(lambda: sender.replies, 10, "the refusal")
    assert reply.error == "too_large" and sender.refusals_seen == [] and len(notifier.ids) == 1


def test_the_outbox_publishes_every_event_in_order_once_through_a_store_that_refuses_for_a_while(
    notifier: StoreThatBlinks, sender: Sender
) -> None:
    notifier.refusals = 4
    for number in range(6):
        event = "huge" if number == 3 else "round"
        sender.asks.append(("outbox", {"event": event, "number": number}))
    wait_for(lambda: len(notifier.published) == 5, 20, "the five events the notifier can take")
    assert [data["number"] for data in notifier.published] == [0, 1, 2, 4, 5], "in order, each once; 3 dropped"
    wait_for(lambda: not sender.outbox.queued, 5, "an empty outbox")
