"""Exactly once at the notifier (issue 45): an event is published once under its key, however often it is sent, by
whichever incarnation of its publisher (a registry restarted sends its saved outbox again), and by whichever replica
of the notifier (one that takes over knows the keys of the history it loads)."""

from __future__ import annotations

from typing import Any

from elastic_control_plane.bus.client import Client
from elastic_control_plane.bus.contract import PUBLISH_KEY
from elastic_control_plane.bus.outbox import QueuedEvent
from elastic_control_plane.services.notifier.service import NotifierService
from testing.harness import free_ports, serve_in_thread


def publish(notifier: NotifierService, sender: str, key: str, data: dict[str, Any]) -> dict[str, Any]:
    client = Client(notifier.endpoint, sender, timeout=1.0, deadline=5.0)
    try:
        return client.request("publish", {"event": "round", "data": data, "key": key}).body
    finally:
        client.close()


def kept(notifier: NotifierService) -> list[list[Any]]:
    client = Client(notifier.endpoint, "test-reader", timeout=1.0, deadline=5.0)
    try:
        return client.request("since", {"seq": 0}).body["events"]
    finally:
        client.close()


def test_an_event_sent_again_by_a_restarted_publisher_is_published_once(notifier: NotifierService) -> None:
    first = publish(notifier, "registry::1:aaaa", "key-1", {"round": 1})
    again = publish(notifier, "registry::2:bbbb", "key-1", {"round": 1})
    after = publish(notifier, "registry::2:bbbb", "key-2", {"round": 2})
    assert first == {"seq": 1}
    assert again == {"seq": 1, "published_already": True}
    assert after == {"seq": 2}
    assert [(body["round"], body[PUBLISH_KEY]) for _, body in kept(notifier)] == [(1, "key-1"), (2, "key-2")]


def test_a_saved_outbox_keeps_each_events_key() -> None:
    event = QueuedEvent("round", {"round": 1}, "key-1")
    assert QueuedEvent.saved(list(event)) == event
    older = QueuedEvent.saved(["round", {"round": 1}])
    assert (older.type, older.data, len(older.key)) == ("round", {"round": 1}, 32)


class KeptEvents:
    """The notifier's history as etcd keeps it for a replica that takes over: one event, published under key-1."""

    def __init__(self) -> None:
        self.appended: list[dict[str, Any]] = []

    def load(self) -> tuple[str | None, int, list[tuple[str, dict[str, Any]]]]:
        body = {"round": 1, "seq": 7, "incarnation": "left-by-the-last", "time": 0.0, PUBLISH_KEY: "key-1"}
        return "left-by-the-last", 7, [("round", body)]

    def append(self, incarnation: str, event: str, body: dict[str, Any], dropped: list[int]) -> None:
        self.appended.append(body)


def test_a_notifier_that_took_over_publishes_no_event_of_its_history_again() -> None:
    ports = free_ports(2)
    log = KeptEvents()
    service = NotifierService(
        f"tcp://127.0.0.1:{ports[0]}",
        f"tcp://127.0.0.1:{ports[1]}",
        event_log=log,  # type: ignore[arg-type]
    )
    serving = serve_in_thread(service)
    next(serving)
    try:
        assert publish(service, "registry::1:aaaa", "key-1", {"round": 1}) == {"seq": 7, "published_already": True}
        assert publish(service, "registry::1:aaaa", "key-2", {"round": 2}) == {"seq": 8}
        assert [body["seq"] for body in log.appended] == [8]
    finally:
        serving.close()
