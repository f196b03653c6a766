"""Junk at every socket of the control plane: each process keeps answering and its memory stays bounded.

For each socket (the four services' ROUTERs, an agent's ipc ROUTER, the
notifier's XPUB events socket) the test sends `JUNK_PER_SOCKET` messages from a
few peers without waiting for replies: malformed frames, unknown types,
oversized bodies, forged replies and events, requests with unique (sender, id)
pairs that fill the reply cache, requests that park, subscription storms. It
reads the owning process's resident memory after a warm-up batch, all along
the junk (the peak, printed), and after it: once a fence sent last by every
peer has come back (a ROUTER), or once the notifier has cut the storm's peers
and they left (the events socket). It asserts the growth
stays under `RSS_GROWTH_LIMIT` and every process still answers (the events
socket: a new subscriber gets events once the storm's peers left).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
import zmq

from elastic_control_plane.agent.agent import agent_endpoint
from elastic_control_plane.bus.envelope import MAX_MESSAGE_BYTES, Message, decode, encode
from elastic_control_plane.bus.pubsub import EVENT_TOPIC
from elastic_control_plane.bus.sockets import HARD_MAX_MESSAGE_BYTES
from testing.harness import Cluster, rss_bytes, wait_for

JUNK_PER_SOCKET = 20_000
WARM_UP = 1_000
PEERS = 4
STORM_PEERS = 20
TOPICS_PER_SUBSCRIBER = 10
RSS_GROWTH_LIMIT = 20 * 1024 * 1024
FENCE_TIMEOUT = 60.0
FENCE_RESEND = 5.0
SETTLE_TIMEOUT = 5.0

Frames = list[bytes]
Junk = Callable[[random.Random, int], Frames]


def settled_rss_bytes(pid: int, before: int) -> int:
    """The process's RSS once it has grown by less than RSS_GROWTH_LIMIT since `before`, or after SETTLE_TIMEOUT the
    last reading: a service hands freed memory back when its loop is next idle, which may be just after the fence."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while True:
        rss = rss_bytes(pid)
        if rss - before < RSS_GROWTH_LIMIT or time.monotonic() > deadline:
            return rss
        time.sleep(0.05)


def _header(msg_type: str, msg_id: str, sender: str, *, reply: bool = False, version: int = 1) -> bytes:
    return msgpack.packb({"v": version, "type": msg_type, "id": msg_id, "round": None, "from": sender, "reply": reply})


def _request(msg_type: str, body: dict[str, object], msg_id: str, sender: str, raw: tuple[bytes, ...] = ()) -> Frames:
    return encode(Message(type=msg_type, body=body, id=msg_id, sender=sender, raw=raw))


def _sender(rng: random.Random) -> str:
    return f"junk-{rng.randrange(1 << 30)}"


def common_junk(known_types: tuple[str, ...]) -> Junk:
    """Junk any ROUTER gets, a different kind for each n; every request has its own (sender, id)."""

    def make(rng: random.Random, n: int) -> Frames:
        sender, msg_id = _sender(rng), f"id-{n}"
        kind = n % 8
        if kind == 0:
            return [rng.randbytes(rng.randrange(1, 300))]
        if kind == 1:
            return [b"\xc1" + rng.randbytes(20), rng.randbytes(50)]
        if kind == 2:
            return [_header("ping", msg_id, sender), msgpack.packb([1, 2, 3])]
        if kind == 3:
            return [_header("ping", msg_id, sender, version=rng.randrange(2, 99)), msgpack.packb({})]
        if kind == 4:
            return _request(f"no-such-type-{rng.randrange(1 << 30)}", {"x": rng.randbytes(100)}, msg_id, sender)
        if kind == 5:
            return [
                _header(rng.choice(known_types), msg_id, sender, reply=True),
                msgpack.packb({"forged": rng.randbytes(200)}),
            ]
        if kind == 6:
            return _request(
                rng.choice(known_types), {"host": rng.randrange(100), "spec": rng.randbytes(64)}, msg_id, sender
            )
        return _request(rng.choice(known_types), {"blob": rng.randbytes(rng.randrange(8_000, 32_000))}, msg_id, sender)

    return make


def rendezvous_junk(rng: random.Random, n: int) -> Frames:
    """Parked requests (lookups of keys never set, joins for hosts of no round), oversized values, and the rest."""
    sender, msg_id = _sender(rng), f"id-{n}"
    if n % 8 == 0:
        return _request("kv_get", {"key": f"never-set/{n}"}, msg_id, sender)
    if n % 8 == 1:
        return _request("enter_round", {"host": f"junk-host-{n}", "slots": [[n % 8, 0, n]]}, msg_id, sender)
    if n % 8 == 2:
        return _request("kv_set", {"key": f"junk/{n}"}, msg_id, sender, raw=(rng.randbytes(rng.randrange(1, 20_000)),))
    return common_junk(("kv_set", "kv_get", "enter_round", "new_round", "forget"))(rng, n)


def notifier_junk(rng: random.Random, n: int) -> Frames:
    """Forged publishes (they fill the history), some too large, catch-up requests, and the rest."""
    sender, msg_id = _sender(rng), f"id-{n}"
    if n % 4 == 0:
        size = rng.randrange(100, 4000) if n % 400 else 2 * 1024 * 1024
        return _request("publish", {"event": f"forged-{n}", "data": {"blob": rng.randbytes(size)}}, msg_id, sender)
    if n % 1000 == 1:
        return _request("since", {"seq": 0}, msg_id, sender)
    return common_junk(("publish", "since"))(rng, n)


def agent_junk(rng: random.Random, n: int) -> Frames:
    """Requests the agent forwards and parks (lookups of keys never set), workers' requests, and the rest."""
    sender, msg_id = _sender(rng), f"id-{n}"
    if n % 8 == 0:
        return _request("kv_get", {"key": f"never-set/{n}"}, msg_id, sender)
    if n % 8 == 1:
        return _request("standby", {"pid": rng.randrange(1 << 30)}, msg_id, sender)
    if n % 8 == 2:
        return _request("subscribe", {"pid": rng.randrange(1 << 30)}, msg_id, sender)
    return common_junk(("kv_set", "kv_get", "standby", "committed", "subscribe"))(rng, n)


def _junk(make: Junk, start: int, count: int) -> Iterator[Frames]:
    rng = random.Random(start)
    return (make(rng, n) for n in range(start, start + count))


class Flood:
    """A few DEALER peers that send junk without waiting, drain whatever comes back, and end with a fenced ping."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.peers = [self._dealer() for _ in range(PEERS)]
        self.next_peer = 0
        self.fences = 0
        self.poller = zmq.Poller()
        for peer in self.peers:
            self.poller.register(peer, zmq.POLLIN | zmq.POLLOUT)

    def _dealer(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(self.endpoint)
        return sock

    def send(self, junk: Iterator[Frames]) -> None:
        """Send everything, each message to the next peer with room; wait for room (draining replies) when none has."""
        for frames in junk:
            while not self._send_to_any(frames):
                self.poller.poll(100)
                self._drain()

    def _send_to_any(self, frames: Frames) -> bool:
        for _ in self.peers:
            peer = self.peers[self.next_peer]
            self.next_peer = (self.next_peer + 1) % len(self.peers)
            try:
                peer.send_multipart(frames, zmq.NOBLOCK)
                return True
            except zmq.Again:
                continue
        return False

    def _drain(self) -> set[str]:
        ids = set()
        for peer in self.peers:
            while True:
                try:
                    ids.add(decode(peer.recv_multipart(zmq.NOBLOCK)).id)
                except zmq.Again:
                    break
        return ids

    def fence(self) -> None:
        """Return once every peer's last request is answered: the process has handled everything they sent. A fence
        unanswered for FENCE_RESEND seconds is sent again, with its id: a ROUTER drops a reply to a peer whose queue is
        full (a loaded machine drains the junk's replies slowly), and the resent one, after all the junk, proves it
        as well."""
        waiting = {}
        for peer in self.peers:
            self.fences += 1
            waiting[f"fence-{self.fences}"] = peer
        deadline, resend_at = time.monotonic() + FENCE_TIMEOUT, 0.0
        while waiting and time.monotonic() < deadline:
            if time.monotonic() >= resend_at:
                for fence, peer in waiting.items():
                    peer.send_multipart(_request("ping", {}, fence, "junk-fence"))
                resend_at = time.monotonic() + FENCE_RESEND
            self.poller.poll(100)
            for answered in self._drain():
                waiting.pop(answered, None)
        assert not waiting, f"{self.endpoint}: no answer to {sorted(waiting)} within {FENCE_TIMEOUT:g}s"

    def oversized(self) -> None:
        """One message over MAX_MESSAGE_BYTES (refused with `too_large`), one frame over what libzmq reads (peer
        dropped)."""
        polite, dropped = self._dealer(), self._dealer()
        try:
            polite.send_multipart([_header("ping", "big", "junk"), msgpack.packb({}), bytes(MAX_MESSAGE_BYTES + 1)])
            assert polite.poll(FENCE_TIMEOUT * 1000), f"{self.endpoint}: no answer to an oversized message"
            assert decode(polite.recv_multipart()).body.get("error") == "too_large"
            dropped.send_multipart(
                [_header("ping", "huge", "junk"), msgpack.packb({}), bytes(HARD_MAX_MESSAGE_BYTES + 1)]
            )
        finally:
            polite.close()
            dropped.close()

    def close(self) -> None:
        for peer in self.peers:
            peer.close()


@dataclass
class Measured:
    """A process's RSS after the warm-up, its highest while junk came in, and after the junk, in bytes."""

    before: int
    peak: int
    after: int
    seconds: float

    def __str__(self) -> str:
        return (
            f"RSS {self.before / 2**20:5.1f} MB -> {self.after / 2**20:5.1f} MB "
            f"({(self.after - self.before) / 2**20:+5.1f} MB), "
            f"peak {self.peak / 2**20:5.1f} MB, {self.seconds:4.1f} s"
        )


class PeakRss:
    """The highest RSS of a process while in the `with` block, read by a thread every 10 ms."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_bytes(pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def flood_router(ctx: zmq.Context, endpoint: str, pid: int, make: Junk) -> Measured:
    """RSS of `pid` after a warm-up batch of junk, while JUNK_PER_SOCKET more come in, and after."""
    started = time.monotonic()
    flood = Flood(ctx, endpoint)
    try:
        flood.send(_junk(make, 0, WARM_UP))
        flood.fence()
        before = rss_bytes(pid)
        with PeakRss(pid) as peak:
            flood.send(_junk(make, WARM_UP, JUNK_PER_SOCKET))
            flood.oversized()
            flood.fence()
        return Measured(before, peak.peak, settled_rss_bytes(pid, before), time.monotonic() - started)
    finally:
        flood.close()


def subscription_junk(rng: random.Random, n: int) -> Frames:
    """What an XSUB peer may send into the events socket: subscriptions and cancels of random topics, forged frames."""
    kind = n % 8
    if kind < 4:
        return [b"\x01" + rng.randbytes(rng.randrange(1, 128))]
    if kind == 4:
        return [b"\x00" + rng.randbytes(rng.randrange(1, 128))]
    if kind == 5:
        forged = encode(
            Message(
                type="round",
                body={"seq": n, "incarnation": "forged", "blob": rng.randbytes(rng.randrange(1, 500))},
                sender="notifier",
            )
        )
        return [EVENT_TOPIC, *forged]
    return [bytes([rng.randrange(2, 256)]) + rng.randbytes(rng.randrange(1, 200))]


class Storm:
    """XSUB peers that send junk into the events socket, SUB peers subscribed to random topics, and forgers that send
    forged events larger than a frame may be there (libzmq drops them)."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.sockets: list[zmq.Socket] = []
        self.peers = [self._socket(zmq.XSUB, sndhwm=JUNK_PER_SOCKET) for _ in range(STORM_PEERS)]
        rng = random.Random(0)
        for _ in range(STORM_PEERS):
            subscriber = self._socket(zmq.SUB)
            for _ in range(TOPICS_PER_SUBSCRIBER):
                subscriber.setsockopt(zmq.SUBSCRIBE, rng.randbytes(rng.randrange(1, 64)))

    def _socket(self, kind: int, sndhwm: int = 1000) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.sndhwm = sndhwm
        sock.connect(self.endpoint)
        self.sockets.append(sock)
        return sock

    def send(self, start: int, count: int) -> None:
        rng = random.Random(start)
        for n in range(start, start + count):
            self.peers[n % STORM_PEERS].send_multipart(subscription_junk(rng, n))

    def forge(self) -> None:
        """From new peers, forged events larger than a frame to the events socket may be."""
        rng = random.Random(-1)
        for _ in range(STORM_PEERS):
            forged = encode(
                Message(
                    type="round",
                    body={"seq": 10**9, "incarnation": "forged", "blob": rng.randbytes(2000)},
                    sender="notifier",
                )
            )
            self._socket(zmq.XSUB).send_multipart([EVENT_TOPIC, *forged])

    def fence(self) -> None:
        """Return once every XSUB peer, subscribing until it does, receives an event: the notifier has read all the
        peer sent before."""
        deadline = time.monotonic() + FENCE_TIMEOUT
        waiting = set(self.peers)
        poller = zmq.Poller()
        for peer in waiting:
            poller.register(peer, zmq.POLLIN)
        while waiting:
            assert time.monotonic() < deadline, (
                f"no event reached {len(waiting)} storm peer(s) within {FENCE_TIMEOUT:g}s"
            )
            for peer in waiting:
                peer.send(b"\x01" + EVENT_TOPIC)
            for peer, _ in poller.poll(300):
                while peer.poll(0):
                    peer.recv_multipart()
                waiting.discard(peer)
                poller.unregister(peer)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def flood_events(ctx: zmq.Context, cluster: Cluster) -> Measured:
    """RSS of the notifier after a warm-up storm (under its bound on foreign subscriptions), all along a storm of
    thousands of them until the notifier cuts the storm's peers, and once they left; then a new subscriber gets
    events. (Peers that stay connected subscribe again each time they reconnect, and the notifier cuts them again:
    its memory goes up and down with them; what is asserted is that nothing stays once they are gone.)"""
    started = time.monotonic()
    pid = cluster.processes["notifier"].pid
    storm = Storm(ctx, cluster.endpoints.events)
    try:
        storm.send(0, WARM_UP)
        storm.fence()
        assert "events_socket_rebound" not in cluster.output("notifier"), (
            "the warm-up alone reached the notifier's bound"
        )
        before = rss_bytes(pid)
        with PeakRss(pid) as peak:
            storm.send(WARM_UP, JUNK_PER_SOCKET)
            storm.forge()
            wait_for(
                lambda: "events_socket_rebound" in cluster.output("notifier"),
                FENCE_TIMEOUT,
                "the notifier to cut the storm",
            )
            storm.close()
            after = settled_rss_bytes(pid, before)
    finally:
        storm.close()
    assert _receives_an_event(ctx, cluster.endpoints.events), "the events socket sends nothing after the storm"
    return Measured(before, peak.peak, after, time.monotonic() - started)


def _receives_an_event(ctx: zmq.Context, endpoint: str) -> bool:
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        return bool(sub.poll(FENCE_TIMEOUT * 1000))
    finally:
        sub.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_every_socket_stays_bounded_under_junk(cluster: Cluster, ctx: zmq.Context) -> None:
    cluster.start_agent("host-1")
    pids = {name: process.pid for name, process in cluster.processes.items()}
    targets: list[tuple[str, str, int, Junk]] = [
        (
            "discovery",
            cluster.endpoints.discovery,
            pids["discovery"],
            common_junk(("register", "heartbeat", "hosts", "drain", "slots")),
        ),
        ("rendezvous", cluster.endpoints.rendezvous, pids["rendezvous"], rendezvous_junk),
        (
            "registry",
            cluster.endpoints.registry,
            pids["registry"],
            common_junk(("submit", "job", "worker_exited", "cancel")),
        ),
        ("notifier", cluster.endpoints.notifier, pids["notifier"], notifier_junk),
        ("agent", agent_endpoint(Path(cluster.env["ELASTIC_RUN_DIR"]), "host-1"), pids["agent-host-1"], agent_junk),
    ]
    results = {name: flood_router(ctx, endpoint, pid, make) for name, endpoint, pid, make in targets}
    results["notifier events"] = flood_events(ctx, cluster)
    for name, measured in results.items():
        print(f"{name:16} {measured}")
    for service in ("discovery", "rendezvous", "registry", "notifier"):
        assert cluster.call(service, "ping") == {"service": service}
    grown = {
        name: f"{(m.after - m.before) / 2**20:+.1f} MB"
        for name, m in results.items()
        if m.after - m.before >= RSS_GROWTH_LIMIT
    }
    assert not grown, f"resident memory grew by {RSS_GROWTH_LIMIT / 2**20:g} MB or more: {grown}"
