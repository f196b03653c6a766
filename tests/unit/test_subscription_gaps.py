"""A subscriber never skips an event (bus/pubsub.py): found by the decisions soak, where a notifier failed over right
after it published an `abort`; every agent's subscription saw the next event, could not fill the gap while the
notifier was away, delivered the newer event anyway, and the `abort` was lost to all of them."""

from __future__ import annotations

from typing import Any

import zmq

from elastic_control_plane.bus.client import Unreachable
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.pubsub import HEARTBEAT, Subscription

INCARNATION = "n1"


class Notifier:
    """The notifier's `since`, answering from its history, or not at all while `away`."""

    def __init__(self) -> None:
        self.history: list[list[Any]] = []
        self.away = False

    def request(self, msg_type: str, body: dict[str, Any]) -> Message:
        assert msg_type == "since"
        if self.away:
            raise Unreachable("tcp://notifier:1", 1.0)
        events = [event for event in self.history if event[1]["seq"] > body["seq"]]
        return Message(type="since", body={"incarnation": INCARNATION, "latest": len(self.history), "events": events})

    def close(self) -> None:
        """Nothing to close: no socket."""

    def publish(self, event_type: str) -> Message:
        body = {"seq": len(self.history) + 1, "incarnation": INCARNATION}
        self.history.append([event_type, body])
        return Message(type=event_type, body=body)


def test_a_gap_the_notifier_cannot_fill_yet_holds_newer_events_back_until_it_can() -> None:
    ctx = zmq.Context()
    subscription = Subscription(ctx, "inproc://events", "inproc://notifier", "agent")
    subscription._catchup.close()
    notifier = Notifier()
    subscription._catchup = notifier  # type: ignore[assignment]
    try:
        subscription.start()
        delivered = [m.body["seq"] for m in subscription._accept(notifier.publish("round"))]
        notifier.publish("abort")  # published while this subscriber's connection was down: never seen live
        notifier.away = True  # and the notifier fails over before the gap can be filled
        delivered += [m.body["seq"] for m in subscription._accept(notifier.publish("round"))]
        assert delivered == [1], "nothing newer than the gap while it cannot be filled"
        notifier.away = False
        beat = Message(type=HEARTBEAT, body={"seq": 3, "incarnation": INCARNATION})
        delivered += [m.body["seq"] for m in subscription._accept(beat)]
        assert delivered == [1, 2, 3], "the gap and what was held back, in order, once"
        assert [m.body["seq"] for m in subscription._accept(notifier.publish("round"))] == [4]
    finally:
        subscription.close()
        ctx.term()
