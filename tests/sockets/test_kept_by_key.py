"""A service keeps replies and parked requests by the caller's authenticated key (bus/service.py, issue 58): a caller
holding another key that names the same sender and request id gets neither the parked request's answer nor the kept
reply; the caller itself still gets both, a retry included. A host's own key takes one share of the parking lot
whatever sender names it uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from elastic_control_plane.bus.envelope import Message, decode, encode
from elastic_control_plane.bus.kept_requests import ParkingLot
from elastic_control_plane.bus.roles import AGENT
from elastic_control_plane.bus.service import DEFERRED, Request, Service, handles
from elastic_control_plane.bus.sockets import Security, client_socket, generate_keys
from testing.harness import free_ports, serve_in_thread

HOSTS = ("host-1", "host-2")


class Parks(Service):
    """Parks every `wait` until a `release` answers each with the sender and id it was asked under."""

    name = "parks"

    def __init__(self, endpoint: str, security: Security) -> None:
        super().__init__(endpoint, security=security)
        self.waiting: list[Request] = []

    @handles("wait")
    def on_wait(self, request: Request) -> Any:
        self.waiting.append(request)
        return DEFERRED

    @handles("release")
    def on_release(self, request: Request) -> Any:
        for waiting in self.waiting:
            waiting.reply({"answer": f"for {waiting.owner}"})
        released, self.waiting = len(self.waiting), []
        return {"released": released}


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    generate_keys(tmp_path / "keys", agent_hosts=HOSTS)
    return tmp_path / "keys"


@pytest.fixture
def parks(keys: Path) -> Iterator[Parks]:
    service = Parks(f"tcp://127.0.0.1:{free_ports(1)[0]}", Security(keys, role="service"))
    yield from serve_in_thread(service)  # type: ignore[misc]


class Caller:
    """A raw DEALER holding one host's key, sending messages with the sender name and id it chooses."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: Path, host: str) -> None:
        self.sock = client_socket(ctx, zmq.DEALER, endpoint, Security(keys, role=AGENT, host=host))

    def send(self, msg_type: str, sender: str, msg_id: str) -> None:
        self.sock.send_multipart(encode(Message(type=msg_type, id=msg_id, sender=sender)))

    def receive(self, timeout_ms: int) -> Message | None:
        if not self.sock.poll(timeout_ms):
            return None
        return decode(self.sock.recv_multipart())


def test_another_key_naming_the_same_sender_and_id_reaches_neither_the_parked_request_nor_the_kept_reply(
    parks: Parks, keys: Path
) -> None:
    ctx = zmq.Context()
    victim, thief = (Caller(ctx, parks.endpoint, keys, host) for host in HOSTS)
    try:
        victim.send("wait", "agent-host-1", "7")
        assert victim.receive(300) is None, "parked"
        thief.send("wait", "agent-host-1", "7")  # before: this moved the parked request's way back to the thief
        victim.send("release", "agent-host-1", "8")
        replies = [victim.receive(5000), victim.receive(5000)]
        answers = {m.id: m.body for m in replies if m is not None}
        assert answers["7"]["answer"].startswith("for ") and answers["8"] == {"released": 2}
        stolen = thief.receive(5000)
        assert stolen is not None and stolen.id == "7" and stolen.body["answer"] != answers["7"]["answer"], (
            "the thief's own request was parked and answered apart"
        )
        victim.send("wait", "agent-host-1", "7")  # a retry: the kept reply, not a new wait
        again = victim.receive(5000)
        assert again is not None and again.body == answers["7"]
        thief.send("wait", "agent-host-1", "7")  # the thief's retry gets the thief's own kept reply
        theirs = thief.receive(5000)
        assert theirs is not None and theirs.body == stolen.body
    finally:
        victim.sock.close(linger=0)
        thief.sock.close(linger=0)
        ctx.term()


def test_a_hosts_own_key_takes_one_share_of_the_parking_lot_whatever_sender_names_it_uses(
    parks: Parks, keys: Path
) -> None:
    parks._parked = ParkingLot(per_sender=2, total=100, max_bytes=100_000)
    ctx = zmq.Context()
    greedy, other = (Caller(ctx, parks.endpoint, keys, host) for host in HOSTS)
    try:
        for n in range(3):
            greedy.send("wait", f"made-up-{n}", str(n))
        refused = greedy.receive(5000)
        assert refused is not None and refused.id == "2" and refused.body["error"] == "too_many_parked"
        other.send("wait", "agent-host-2", "1")
        assert other.receive(300) is None, "another host still parks"
    finally:
        greedy.sock.close(linger=0)
        other.sock.close(linger=0)
        ctx.term()
