"""The bounds on what peers can make a service keep: reply cache, parked requests, the rendezvous key-value store,
the notifier's history. Services run in-process on ipc endpoints and are driven through `_dispatch`, their replies
captured instead of sent."""

from __future__ import annotations

import tracemalloc
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_control_plane.bus.contract import PUBLISH_KEY
from elastic_control_plane.bus.envelope import Message, decode, encode
from elastic_control_plane.bus.kept_requests import reply_cost
from elastic_control_plane.bus.service import DEFERRED, ParkingLot, ReplyCache, Request, Service, handles
from elastic_control_plane.services.notifier import service as notifier_module
from elastic_control_plane.services.notifier.service import History, NotifierService
from elastic_control_plane.services.rendezvous import service as rendezvous_module
from elastic_control_plane.services.rendezvous.service import RendezvousService


def frames_of(size: int) -> list[bytes]:
    return [b"h", b"x" * (size - 1)]


# -- reply cache ---------------------------------------------------------------------------------------------------
def test_reply_cache_drops_the_oldest_past_its_entries() -> None:
    cache = ReplyCache(entries=2, max_bytes=10_000, entry_bytes=1000)
    for n in range(3):
        cache.put(("s", str(n)), frames_of(10))
    assert cache.get(("s", "0")) is None
    assert cache.get(("s", "2")) == frames_of(10)
    assert (len(cache), cache.nbytes) == (2, 2 * reply_cost(frames_of(10)))


def test_reply_cache_drops_the_oldest_past_its_bytes() -> None:
    room = reply_cost(frames_of(50)) + reply_cost(frames_of(40))
    cache = ReplyCache(entries=100, max_bytes=room, entry_bytes=room)
    cache.put(("s", "a"), frames_of(50))
    cache.put(("s", "b"), frames_of(30))
    cache.put(("s", "c"), frames_of(40))
    assert cache.get(("s", "a")) is None and cache.get(("s", "b")) is not None and cache.get(("s", "c")) is not None
    assert cache.nbytes == reply_cost(frames_of(30)) + reply_cost(frames_of(40))


def test_reply_cache_keeps_no_reply_larger_than_an_entry_may_be() -> None:
    cache = ReplyCache(entries=10, max_bytes=10_000, entry_bytes=reply_cost(frames_of(50)))
    cache.put(("s", "small"), frames_of(50))
    cache.put(("s", "large"), frames_of(51))
    assert cache.get(("s", "large")) is None and cache.get(("s", "small")) is not None
    assert cache.nbytes == reply_cost(frames_of(50))


def test_reply_cache_counts_a_replaced_reply_once() -> None:
    cache = ReplyCache(entries=10, max_bytes=10_000, entry_bytes=1000)
    cache.put(("s", "a"), frames_of(40))
    cache.put(("s", "a"), frames_of(10))
    assert (len(cache), cache.nbytes) == (1, reply_cost(frames_of(10)))


@pytest.mark.parametrize("reply_bytes", [60, 250, 2000])
def test_reply_cache_counts_the_memory_its_replies_hold(reply_bytes: int) -> None:
    """Its byte bound bounds memory: what it counts is within 20 % of what tracemalloc sees it hold, for replies of
    the sizes services give (a heartbeat's, a join's, a status's), with keys made as decoding makes them."""
    cache, replies = ReplyCache(entries=100_000, max_bytes=2**40), 5000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(replies):
            cache.put((f"agent-{uuid.uuid4().hex[:8]}", str(100_000 + n)), [b"h" * 40, bytes(reply_bytes)])
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.8 < cache.nbytes / held < 1.2, (cache.nbytes / replies, held / replies)


def test_a_replayable_handler_keeps_no_reply(tmp_path: Path) -> None:
    """A read or a heartbeat is answered afresh on a retry; a handler that changes state answers a retry from the
    cache."""

    class Counting(Service):
        name = "counting"
        calls = 0

        @handles("read", replayable=True)
        def on_read(self, request: Request) -> dict[str, Any]:
            self.calls += 1
            return {"calls": self.calls}

        @handles("write")
        def on_write(self, request: Request) -> dict[str, Any]:
            self.calls += 1
            return {"calls": self.calls}

    service = Counting(f"ipc://{tmp_path}/counting")
    sent: list[list[bytes]] = []
    service._send = lambda route, frames: sent.append(frames)  # type: ignore[method-assign]
    try:
        for msg_type in ("read", "read", "write", "write"):
            service._dispatch(b"r", encode(Message(type=msg_type, id=msg_type, sender="agent-1")))
        assert [decode(frames).body["calls"] for frames in sent] == [1, 2, 3, 3]
        assert len(service._replied) == 1
    finally:
        service.close()


# -- parking lot ---------------------------------------------------------------------------------------------------
def parked(sender: str, msg_id: str, size: int = 10) -> Request:
    return Request(None, Message(type="wait", id=msg_id, sender=sender), b"route", (sender, msg_id), size)  # type: ignore[arg-type]


def park(lot: ParkingLot, request: Request) -> None:
    assert lot.refusal(request.owner, request.size) is None
    lot.park(request.parking_key, request)


def test_parking_lot_bounds_each_sender() -> None:
    lot = ParkingLot(per_sender=2, total=10, max_bytes=1000)
    park(lot, parked("a", "1"))
    park(lot, parked("a", "2"))
    assert "sender 'a' has 2 requests parked" in (lot.refusal("a", 10) or "")
    assert lot.refusal("b", 10) is None
    lot.unpark(("a", "1"))
    assert lot.refusal("a", 10) is None


def test_parking_lot_bounds_the_total_and_the_bytes() -> None:
    lot = ParkingLot(per_sender=10, total=2, max_bytes=100)
    park(lot, parked("a", "1", size=60))
    assert "would exceed the 100" in (lot.refusal("b", 41) or "")
    assert lot.refusal("b", 40) is None
    park(lot, parked("b", "1", size=40))
    assert "2 requests are parked already" in (lot.refusal("c", 0) or "")
    assert (len(lot), lot.nbytes) == (2, 100)


def test_parking_lot_refuses_one_large_request_and_parks_the_small_ones_beside() -> None:
    """A 12 MiB lookup once filled the lot for everyone (issue 58); it is refused, and ordinary ones still park."""
    lot = ParkingLot(per_sender=10, total=10, max_bytes=1000, max_request_bytes=200)
    assert "at most 200" in (lot.refusal("junk", 201) or "")
    park(lot, parked("worker", "1", size=200))
    park(lot, parked("junk", "2", size=130))


def test_parking_lot_forgets_a_sender_with_nothing_parked() -> None:
    lot = ParkingLot(per_sender=1, total=10, max_bytes=1000)
    park(lot, parked("a", "1"))
    lot.unpark(("a", "1"))
    lot.unpark(("a", "1"))
    assert (len(lot), lot.nbytes, dict(lot._by_sender)) == (0, 0, {})


# -- the service's loop: parked requests are refused past the bound -----------------------------------------------
class Replies:
    """Replies a service sends, by request id, captured instead of sent."""

    def __init__(self, service: Service) -> None:
        self.by_id: dict[str, Message] = {}
        service._send = self._capture  # type: ignore[method-assign]

    def _capture(self, route: bytes, frames: list[bytes]) -> None:
        reply = decode(frames)
        self.by_id[reply.id] = reply


def request(
    service: Service,
    msg_type: str,
    body: dict[str, Any],
    msg_id: str,
    sender: str = "peer",
    raw: tuple[bytes, ...] = (),
) -> None:
    service._dispatch(b"route", encode(Message(type=msg_type, body=body, id=msg_id, sender=sender, raw=raw)))


class Waiter(Service):
    name = "waiter"

    def __init__(self, endpoint: str) -> None:
        super().__init__(endpoint)
        self.waiting: list[Request] = []

    @handles("wait")
    def on_wait(self, request: Request) -> Any:
        self.waiting.append(request)
        return DEFERRED


@pytest.fixture
def waiter(tmp_path: Path) -> Iterator[Waiter]:
    service = Waiter(f"ipc://{tmp_path}/waiter.sock")
    service._parked = ParkingLot(per_sender=2, total=3, max_bytes=10_000)
    yield service
    service.close()


def test_a_sender_past_its_parked_requests_is_refused_and_others_are_not(waiter: Waiter) -> None:
    replies = Replies(waiter)
    for n in range(3):
        request(waiter, "wait", {}, f"a{n}", sender="a")
    assert replies.by_id["a2"].body["error"] == "too_many_parked"
    assert "a0" not in replies.by_id and "a1" not in replies.by_id
    request(waiter, "wait", {}, "a1", sender="a")
    assert "a1" not in replies.by_id, "a retry of a parked request is not a new one"
    request(waiter, "wait", {}, "b0", sender="b")
    request(waiter, "wait", {}, "b1", sender="b")
    assert "b0" not in replies.by_id and replies.by_id["b1"].body["error"] == "too_many_parked"
    request(waiter, "ping", {}, "p", sender="a")
    assert replies.by_id["p"].body == {"service": "waiter"}
    waiter.waiting[0].reply({"done": True})
    request(waiter, "wait", {}, "a3", sender="a")
    assert "a3" not in replies.by_id, "an answered request frees its place"


def test_the_first_request_of_a_type_to_park_is_refused_after_its_handler_when_the_lot_is_full(waiter: Waiter) -> None:
    replies = Replies(waiter)
    waiter._parked = ParkingLot(per_sender=1, total=1, max_bytes=10_000)
    waiter._parked.park(("x", "1"), parked("x", "1"))
    request(waiter, "wait", {}, "first", sender="a")
    assert replies.by_id["first"].body["error"] == "too_many_parked"
    assert len(waiter._parked) == 1


# -- the rendezvous key-value store --------------------------------------------------------------------------------
@pytest.fixture
def rendezvous(tmp_path: Path) -> Iterator[RendezvousService]:
    service = RendezvousService(f"ipc://{tmp_path}/rendezvous.sock")
    yield service
    service.close()


def new_round(rendezvous: RendezvousService, number: int, host: str = "h") -> None:
    request(rendezvous, "new_round", {"hosts": [[host, 1]], "min_np": 1}, f"round{number}", sender="registry")


def test_kv_refuses_long_keys_large_values_and_keys_past_the_most_it_keeps(
    rendezvous: RendezvousService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rendezvous_module, "MAX_KV_KEYS", 2)
    new_round(rendezvous, 1)
    new_round(rendezvous, 2)
    replies = Replies(rendezvous)
    key = "round/1/" + "k" * rendezvous_module.MAX_KV_KEY_BYTES
    request(rendezvous, "kv_set", {"key": key, "host": "h"}, "long", raw=(b"v",))
    request(rendezvous, "kv_get", {"key": "round/1/" + "é" * (rendezvous_module.MAX_KV_KEY_BYTES // 2)}, "long-get")
    big = (b"v" * (rendezvous_module.MAX_KV_VALUE_BYTES + 1),)
    request(rendezvous, "kv_set", {"key": "round/1/big", "host": "h"}, "big", raw=big)
    request(rendezvous, "kv_set", {"key": "round/1/a", "host": "h"}, "a", raw=(b"1",))
    request(rendezvous, "kv_set", {"key": "round/2/b", "host": "h"}, "b", raw=(b"2",))
    request(rendezvous, "kv_set", {"key": "round/2/c", "host": "h"}, "c", raw=(b"3",))
    request(rendezvous, "kv_set", {"key": "round/1/a", "host": "h"}, "a-again", raw=(b"4",))
    assert {i: r.body.get("error") for i, r in replies.by_id.items()} == {
        "long": "key_too_long",
        "long-get": "key_too_long",
        "big": "value_too_large",
        "a": None,
        "b": None,
        "c": "too_many_keys",
        "a-again": None,
    }
    assert rendezvous.kv == {"round/1/a": b"4", "round/2/b": b"2"}


def test_kv_keeps_round_keys_only_and_a_host_past_its_rounds_quota_stalls_no_later_round(
    rendezvous: RendezvousService,
) -> None:
    """Issue 58: 1,024 junk keys once refused every later round's store address. A key outside every round is
    refused; a round's host past its quota is refused `quota` in that round alone, and the next round (its junk
    dropped with the round before last) takes its store address."""
    new_round(rendezvous, 1)
    replies = Replies(rendezvous)
    request(rendezvous, "kv_set", {"key": "junk/1", "host": "h"}, "outside", raw=(b"x",))
    request(rendezvous, "kv_get", {"key": "never-set/1"}, "outside-get", sender="worker")
    for n in range(rendezvous_module.MAX_KV_KEYS_PER_ROUND):
        request(rendezvous, "kv_set", {"key": f"round/1/junk{n}", "host": "h"}, f"junk{n}", raw=(b"x",))
    request(rendezvous, "kv_set", {"key": "round/1/store", "host": "h"}, "past-quota", raw=(b"h:1",))
    request(rendezvous, "kv_set", {"key": "round/1/junk0", "host": "h"}, "rewrite", raw=(b"y",))
    assert replies.by_id["outside"].body["error"] == "not_a_round_key"
    assert replies.by_id["outside-get"].body["error"] == "not_a_round_key"
    assert replies.by_id["past-quota"].body["error"] == "quota", "the guilty host's round is refused"
    assert replies.by_id["rewrite"].body.get("error") is None, "a key it holds may be set again"
    request(rendezvous, "status", {}, "status", sender="registry")
    assert replies.by_id["status"].body["quota_refused"] == {"h": 1}, "status names the host, no other"
    for number in (2, 3):
        new_round(rendezvous, number)
    request(rendezvous, "kv_set", {"key": "round/3/store", "host": "h"}, "innocent", raw=(b"h:2",))
    assert replies.by_id["innocent"].body.get("error") is None and rendezvous.kv["round/3/store"] == b"h:2"
    assert not any(key.startswith("round/1/") for key in rendezvous.kv), "round 1's junk went with it"


def test_kv_refuses_lookups_past_the_most_that_may_wait(
    rendezvous: RendezvousService, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rendezvous_module, "MAX_KV_WAITERS", 2)
    new_round(rendezvous, 1)
    replies = Replies(rendezvous)
    for n in range(3):
        request(rendezvous, "kv_get", {"key": f"round/1/k{n % 2}"}, f"get{n}", sender=f"worker{n}")
    assert replies.by_id["get2"].body["error"] == "too_many_waiters"
    request(rendezvous, "kv_set", {"key": "round/1/k0", "host": "h"}, "set", raw=(b"v",))
    assert replies.by_id["get0"].raw == (b"v",) and rendezvous.kv_waiting == 1
    request(rendezvous, "kv_get", {"key": "round/1/k2"}, "get3", sender="worker3")
    assert "get3" not in replies.by_id, "an answered lookup frees its place"


def test_lookups_still_waiting_are_refused_when_their_round_is_dropped_or_the_job_reset(
    rendezvous: RendezvousService,
) -> None:
    replies = Replies(rendezvous)
    for n in (1, 2):
        request(rendezvous, "new_round", {"hosts": [["h", 1]], "min_np": 1}, f"round{n}", sender="registry")
    request(rendezvous, "kv_get", {"key": "round/1/store"}, "old", sender="worker")
    request(rendezvous, "kv_get", {"key": "round/2/store"}, "current", sender="worker")
    request(rendezvous, "new_round", {"hosts": [["h", 1]], "min_np": 1}, "round3", sender="registry")
    assert replies.by_id["old"].body["error"] == "stale_round" and "current" not in replies.by_id
    request(rendezvous, "reset", {}, "reset", sender="registry")
    assert replies.by_id["current"].body["error"] == "job_reset"
    assert (rendezvous.kv_waiting, len(rendezvous._parked)) == (0, 0)


# -- the notifier's history ----------------------------------------------------------------------------------------
def test_history_keeps_the_latest_events_within_its_count_and_bytes() -> None:
    history = History(events=3, max_bytes=100)
    for seq in range(1, 5):
        history.append("e", {"seq": seq}, 10)
    assert [body["seq"] for _, body in history.since(0)] == [2, 3, 4]
    history.append("big", {"seq": 5}, 85)
    assert [body["seq"] for _, body in history.since(0)] == [4, 5]
    assert (len(history), history.nbytes) == (2, 95)
    assert history.since(4) == [["big", {"seq": 5}]]


def test_history_knows_the_publish_keys_of_the_events_it_keeps_only() -> None:
    history = History(events=2, max_bytes=100)
    for seq in range(1, 4):
        history.append("e", {"seq": seq, PUBLISH_KEY: f"key-{seq}"}, 10)
    history.append("e", {"seq": 4}, 10)
    assert [history.published(f"key-{seq}") for seq in range(1, 4)] == [None, None, 3]
    assert len(history._seq_by_key) == 1, "a key goes with its event"


@pytest.fixture
def notifier(tmp_path: Path) -> Iterator[NotifierService]:
    service = NotifierService(f"ipc://{tmp_path}/notifier.sock", f"ipc://{tmp_path}/events.sock")
    yield service
    service.close()


def test_notifier_refuses_an_event_too_large_and_keeps_its_sequence(notifier: NotifierService) -> None:
    replies = Replies(notifier)
    request(notifier, "publish", {"event": "big", "data": {"blob": b"x" * notifier_module.MAX_EVENT_BYTES}}, "big")
    request(notifier, "publish", {"event": "small", "data": {}}, "small")
    assert replies.by_id["big"].body["error"] == "too_large"
    assert replies.by_id["small"].body == {"seq": 1}
    assert [event for event, _ in notifier.history.since(0)] == ["small"]
