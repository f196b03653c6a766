"""Clients given an endpoint list (a service's endpoint on every control host) reach whichever replica is bound, and
follow it when another replica binds instead: real sockets on three loopback addresses, one port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import zmq

from elastic_control_plane.bus.client import AsyncClient, Client
from elastic_control_plane.bus.config import tcp_endpoint
from elastic_control_plane.bus.pubsub import Subscription
from elastic_control_plane.bus.service import DEFERRED, Request, Service, handles
from elastic_control_plane.services.notifier.service import NotifierService
from testing.harness import free_ports, serve_in_thread, wait_for

CONTROL_HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
REPO = Path(__file__).resolve().parents[2]
# A replica that binds its ROUTER and answers `ping` (as "service") until it is stopped with SIGSTOP.
PAUSABLE_REPLICA = "import sys; from bus.service import Service; Service(sys.argv[1]).run()"

served = contextmanager(serve_in_thread)


class Replica(Service):
    """One replica of a service: says which endpoint it is bound at."""

    name = "replica"

    @handles("where")
    def on_where(self, request: Request) -> dict[str, Any]:
        return {"endpoint": self.endpoint}


class Asker(Service):
    """A service that asks a replicated service through an AsyncClient and answers with the reply's body."""

    name = "asker"

    def __init__(self, endpoint: str, target: str) -> None:
        super().__init__(endpoint)
        self.client = AsyncClient(self, target, "test-asker")

    @handles("ask")
    def on_ask(self, request: Request) -> object:
        self.client.send(
            request.body["type"],
            on_reply=lambda reply: request.reply(reply.body),
            on_timeout=lambda: request.fail("unreachable", f"no reply from {self.client.endpoint}"),
            timeout=1.0,
            deadline=4.0,
        )
        return DEFERRED


def on_every_host(port: int) -> list[str]:
    return [tcp_endpoint(host, port) for host in CONTROL_HOSTS]


@pytest.fixture
def replicas() -> list[str]:
    """The endpoints of one service's replicas, one per control host, on one port."""
    return on_every_host(free_ports(1)[0])


@pytest.fixture
def asker(replicas: list[str]) -> Iterator[Asker]:
    yield from serve_in_thread(Asker(f"tcp://127.0.0.1:{free_ports(1)[0]}", ",".join(replicas)))  # type: ignore[misc]


@pytest.fixture
def client(replicas: list[str]) -> Iterator[Client]:
    client = Client(",".join(replicas), "test-client", timeout=2.0, deadline=4.0)
    yield client
    client.close()


def timed(call: Any) -> tuple[Any, float]:
    started = time.monotonic()
    return call(), time.monotonic() - started


def test_a_client_reaches_the_bound_replica_at_once_and_follows_it_to_another(
    replicas: list[str], client: Client
) -> None:
    with served(Replica(replicas[1])):
        reply, took = timed(lambda: client.request("where"))
        assert reply.body["endpoint"] == replicas[1]
        assert took < 1.0, f"answered in {took:.2f}s: the first try (timeout 2s) went to the bound replica"
    with served(Replica(replicas[2])):
        reply, took = timed(lambda: client.request("where"))
        assert reply.body["endpoint"] == replicas[2]
        assert took < 1.0, f"answered in {took:.2f}s: the first try after the failover reached the new replica"


def test_an_async_client_in_a_service_follows_the_bound_replica(replicas: list[str], asker: Asker) -> None:
    ask = Client(asker.endpoint, "test-operator", timeout=5.0, deadline=5.0)
    try:
        for replica in (replicas[0], replicas[2]):
            with served(Replica(replica)):
                reply, took = timed(lambda: ask.request("ask", {"type": "where"}))
                assert reply.body["endpoint"] == replica
                assert took < 0.9, f"answered in {took:.2f}s: sent once a connection completed, before a resend (1s)"
    finally:
        ask.close()


def test_a_subscription_gets_the_events_of_whichever_notifier_is_bound() -> None:
    notifiers, events = on_every_host(free_ports(1)[0]), on_every_host(free_ports(1)[0])
    sub = Subscription(zmq.Context.instance(), ",".join(events), ",".join(notifiers), "test-sub")
    publisher = Client(",".join(notifiers), "test-publisher", timeout=1.0, deadline=3.0)
    got: list[int] = []

    def received(want: int) -> bool:
        if sub.sock.poll(50):
            got.extend(msg.body["i"] for msg in sub.receive() if msg.type == "tick")
        return len(got) >= want

    try:
        for i, replica in ((0, 0), (1, 2)):
            with served(NotifierService(notifiers[replica], events[replica], heartbeat=0.1)):
                if i == 0:
                    sub.start()
                publisher.request("publish", {"event": "tick", "data": {"i": i}})
                wait_for(lambda i=i: received(i + 1), 5, f"event {i} from the notifier on {CONTROL_HOSTS[replica]}")
        assert got == [0, 1]
    finally:
        sub.close()
        publisher.close()


@pytest.fixture
def paused_replica(replicas: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    """A replica in a process of its own, bound at the first control host; the test pauses it. Resumed and killed
    after."""
    process = subprocess.Popen(
        [sys.executable, "-c", PAUSABLE_REPLICA, replicas[0]], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        yield process
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(timeout=10)


def test_requests_reach_the_live_replica_while_a_paused_one_holds_its_connections(
    replicas: list[str], client: Client, asker: Asker, paused_replica: subprocess.Popen[bytes]
) -> None:
    """An ex-active replica that stops (SIGSTOP) keeps its TCP connections: a request that goes down one is not
    answered, the client tries again, and only the live replica completes new connections. The connection to the
    paused replica is closed by heartbeats: then every request goes to the live replica at once."""
    ask = Client(asker.endpoint, "test-operator", timeout=5.0, deadline=5.0)
    try:
        wait_for(lambda: client.request("ping").body["service"] == "service", 20, "the paused replica to answer")
        wait_for(lambda: ask.request("ask", {"type": "ping"}).body["service"] == "service", 10, "the asker connected")
        paused_replica.send_signal(signal.SIGSTOP)
        with served(Replica(replicas[1])):
            for _ in range(4):
                assert client.request("where", timeout=1.0, deadline=3.0).body["endpoint"] == replicas[1]
                assert ask.request("ask", {"type": "where"}).body["endpoint"] == replicas[1]

            def answered_at_once(asks: int = 3) -> bool:
                return all(timed(lambda: ask.request("ask", {"type": "where"}))[1] < 0.5 for _ in range(asks))

            wait_for(answered_at_once, 10, "three asks in a row sent to the live replica (resend after 1s)")
    finally:
        ask.close()
