"""Services in-process on random loopback ports, driven through real sockets (the middle test tier)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import zmq

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.bus.envelope import Message, decode, encode
from elastic_control_plane.bus.pubsub import Subscription
from elastic_control_plane.bus.sockets import client_socket
from elastic_control_plane.services.discovery.hostset import HostsDiff, apply_diff
from elastic_control_plane.services.discovery.service import DiscoveryService
from elastic_control_plane.services.notifier.service import NotifierService
from elastic_control_plane.services.rendezvous.service import RendezvousService
from testing.harness import wait_for


def _publish(client: Client, n: int, start: int) -> None:
    for i in range(start, start + n):
        client.request("publish", {"event": "tick", "data": {"i": i}})


def _drain(sub: Subscription, want: int, timeout: float = 5.0) -> list[int]:
    got: list[int] = []

    def more() -> bool:
        if sub.sock.poll(50):
            got.extend(m.body["i"] for m in sub.receive())
        return len(got) >= want

    wait_for(more, timeout, f"{want} events", interval=0)
    return got


def test_a_reconnecting_subscriber_catches_up_in_order_exactly_once(notifier: NotifierService) -> None:
    """Events published while the subscriber is not connected (slow joiner, reconnect) arrive from the history,
    noticed by a sequence gap or by the notifier's heartbeat."""
    ctx = zmq.Context.instance()
    publisher = Client(notifier.endpoint, "test-publisher", timeout=1.0, deadline=2.0)
    sub = Subscription(ctx, notifier.events.sock.getsockopt_string(zmq.LAST_ENDPOINT), notifier.endpoint, "test-sub")
    try:
        sub.start()
        _publish(publisher, 1, 0)
        first = _drain(sub, 1)
        sub.sock.close(linger=0)
        _publish(publisher, 3, 100)
        sub.sock = client_socket(ctx, zmq.SUB, notifier.events.sock.getsockopt_string(zmq.LAST_ENDPOINT))
        got = _drain(sub, 3)
        _publish(publisher, 2, 200)
        got += _drain(sub, 2)
        assert first == [0]
        assert got == [100, 101, 102, 200, 201], "missed events come from history, then live ones, each once"
    finally:
        sub.close()
        publisher.close()


def test_rendezvous_releases_a_round_together_and_refuses_a_round_with_no_previous_host(
    rendezvous: RendezvousService,
) -> None:
    admin = Client(rendezvous.endpoint, "test-admin", timeout=1.0, deadline=2.0)
    answers: dict[tuple[str, int], Any] = {}

    def join(host: str, local_ranks: tuple[int, ...]) -> None:
        client = Client(rendezvous.endpoint, f"agent-{host}", timeout=1.0, deadline=10.0)
        slots = [[local_rank, 0, 1000 + local_rank] for local_rank in local_ranks]
        for local_rank, pid, answer in client.request("enter_round", {"host": host, "slots": slots}).body["answers"]:
            assert pid == 1000 + local_rank
            answers[(host, local_rank)] = answer
        client.close()

    try:
        admin.request("new_round", {"hosts": [["a", 2], ["b", 1]], "min_np": 2, "max_np": None, "hosts_timestamp": 1.0})
        host_a = threading.Thread(target=join, args=("a", (0, 1)))
        host_a.start()
        wait_for(lambda: admin.request("status").body["parked"] == 2, 5, "host a's two slots parked")
        assert answers == {}, "a round is not released before every slot has joined"
        join("b", (0,))
        host_a.join(timeout=5)
        assert sorted((s, a["rank"], a["size"], a["cross_rank"]) for s, a in answers.items()) == [
            (("a", 0), 0, 3, 0),
            (("a", 1), 1, 3, 0),
            (("b", 0), 2, 3, 1),
        ]
        with pytest.raises(ServiceError) as refused:
            admin.request("new_round", {"hosts": [["c", 2]], "min_np": 1, "max_np": None, "hosts_timestamp": 2.0})
        assert refused.value.code == "no_surviving_host" and "a, b" in refused.value.message
        with pytest.raises(ServiceError) as stale:
            admin.request("kv_set", {"key": "round/0/store"}, raw=(b"x",))
        assert stale.value.code == "stale_round"
        admin.request("kv_set", {"key": "round/1/store", "host": "a"}, raw=(b"127.0.0.1:1",))
        assert admin.request("kv_get", {"key": "round/1/store"}).raw == (b"127.0.0.1:1",)
        for claimed in ({"host": "b"}, {}):  # not the host of rank 0, or no host: the address stays
            with pytest.raises(ServiceError) as forbidden:
                admin.request("kv_set", {"key": "round/1/store", **claimed}, raw=(b"10.6.6.6:1",))
            assert forbidden.value.code == "forbidden" and "agent of a" in forbidden.value.message
        assert admin.request("kv_get", {"key": "round/1/store"}).raw == (b"127.0.0.1:1",)
        with pytest.raises(ServiceError) as too_few:
            admin.request("new_round", {"hosts": [["a", 1]], "min_np": 2, "max_np": None, "hosts_timestamp": 2.0})
        assert too_few.value.code == "not_enough_slots"
    finally:
        admin.close()


def test_a_new_round_asked_again_is_the_round_made_and_a_forming_round_can_be_replaced(
    rendezvous: RendezvousService,
) -> None:
    admin = Client(rendezvous.endpoint, "test-admin", timeout=1.0, deadline=2.0)
    try:
        first = admin.request(
            "new_round", {"hosts": [["a", 1], ["b", 1]], "min_np": 1, "hosts_timestamp": 1.0, "round": 1}
        ).body
        again = admin.request("new_round", {"hosts": [["a", 1]], "min_np": 1, "hosts_timestamp": 2.0, "round": 1}).body
        assert first == again == {"round": 1, "size": 2, "hosts": [["a", [0]], ["b", [0]]], "hosts_timestamp": 1.0}
        replaced = admin.request(
            "new_round", {"hosts": [["a", 1]], "min_np": 1, "hosts_timestamp": 2.0, "round": 2, "replaces": 1}
        ).body
        assert replaced["round"] == 2 and replaced["hosts"] == [["a", [0]]]
        with pytest.raises(ServiceError) as stale:
            admin.request("new_round", {"hosts": [["a", 1]], "min_np": 1, "hosts_timestamp": 3.0, "round": 1})
        assert stale.value.code == "stale_round"
        (joined,) = admin.request("enter_round", {"host": "a", "slots": [[0, 0, 1]]}).body["answers"]
        assert joined[2]["round"] == 2 and joined[2]["size"] == 1
        with pytest.raises(ServiceError) as released:
            admin.request(
                "new_round", {"hosts": [["a", 1]], "min_np": 1, "hosts_timestamp": 3.0, "round": 3, "replaces": 2}
            )
        assert released.value.code == "released"
        assert admin.request("status", {"round": 2, "pids": False}).body["pids"] == []
        status = admin.request("status", {"round": 2}).body
        assert (status["pids"], status["rejoins"], status["rejoins_next"]) == ([["a", 0, 1]], [], 0)
        answered: list[Any] = []

        def rejoin() -> None:
            """The survivor's host asks for the next round for it; it waits until its agent withdraws the entry."""
            client = Client(rendezvous.endpoint, "agent-a", timeout=1.0, deadline=10.0)
            try:
                answered.append(client.request("enter_round", {"host": "a", "slots": [[0, 2, 1]]}).body)
            finally:
                client.close()

        survivor = threading.Thread(target=rejoin)
        survivor.start()
        try:
            wait_for(lambda: admin.request("status").body["parked"] == 1, 5, "the survivor's join parked")
            status = admin.request("status", {"round": 2, "rejoins_from": 0, "pids": False}).body
            assert (status["round"], status["rejoins"], status["rejoins_next"]) == (2, [["a", 0, 1, 2]], 1)
            again = admin.request("status", {"round": 2, "rejoins_from": 1, "pids": False}).body
            assert (again["rejoins"], again["rejoins_next"]) == ([], 1), "only the rejoins since the cursor"
            with pytest.raises(ServiceError) as bad:
                admin.request("status", {"round": 2, "rejoins_from": "x"})
            assert bad.value.code == "bad_request"
        finally:
            admin.request("forget", {"host": "a", "local_rank": 0, "pid": 1})
            admin.request("enter_round", {"host": "a", "slots": []})
            survivor.join(timeout=5)
        assert answered == [{"answers": []}], "the withdrawn entry is answered, with nothing"
        assert admin.request("status").body["parked"] == 0
    finally:
        admin.close()


def test_a_burst_of_registrations_makes_a_few_numbered_diffs_that_rebuild_the_host_list(
    notifier: NotifierService, discovery: DiscoveryService
) -> None:
    """Discovery coalesces changes (one hosts_updated per window, not one per host), and the diffs, applied in
    version order from the list announced at configure, give the list `hosts` says was announced."""
    events = notifier.events.sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sub = Subscription(zmq.Context.instance(), events, notifier.endpoint, "test-sub")
    agent = Client(discovery.endpoint, "test-agent", timeout=2.0, deadline=5.0)
    try:
        sub.start()
        agent.request("configure", {})
        start_version = agent.request("hosts").body["version"]
        for i in range(200):
            agent.request("register", {"host": f"h{i:03d}", "slots": 2, "incarnation": "i"})
        agent.request("unregister", {"host": "h007", "incarnation": "i"})
        announced = agent.request("hosts").body
        updates: list[Any] = []

        def all_arrived() -> bool:
            if sub.sock.poll(50):
                updates.extend(m.body for m in sub.receive() if m.type == "hosts_updated")
            return bool(updates) and updates[-1]["version"] == announced["version"]

        wait_for(all_arrived, 10, "every hosts_updated", interval=0)
        assert len(updates) <= 40, f"{len(updates)} events for 201 changes: not coalesced"
        assert [u["version"] for u in updates] == list(range(start_version + 1, announced["version"] + 1))
        hosts: list[tuple[str, tuple[int, ...]]] = []
        for update in updates:
            whole = update.get("hosts")
            hosts = (
                [(n, tuple(s)) for n, s in whole]
                if whole is not None
                else apply_diff(hosts, HostsDiff(update["set"], update["remove"]))
            )
        assert hosts == [(n, tuple(s)) for n, s in announced["published"]]
        assert len(hosts) == 199 and "h007" not in dict(hosts)
    finally:
        agent.close()
        sub.close()


def test_discovery_keeps_each_agents_fork_server_report_and_refuses_a_malformed_one(
    discovery: DiscoveryService,
) -> None:
    agent = Client(discovery.endpoint, "test-agent", timeout=2.0, deadline=5.0)
    try:
        why = "the fork server exited with code 1: ModuleNotFoundError: No module named 'torch'"
        agent.request(
            "register",
            {"host": "h1", "slots": 1, "incarnation": "i", "fork_server": {"state": "starting", "reason": ""}},
        )
        agent.request(
            "heartbeat", {"host": "h1", "incarnation": "i", "fork_server": {"state": "unavailable", "reason": why}}
        )
        agent.request("register", {"host": "h2", "slots": 1, "incarnation": "i"})
        shown = {h["host"]: h["fork_server"] for h in agent.request("hosts").body["all"]}
        assert shown == {"h1": {"state": "unavailable", "reason": why}, "h2": None}, (
            "an agent that reports none shows none"
        )
        for bad in ({"state": "warm"}, {"state": "ready", "reason": 3}, "ready", ["ready"]):
            with pytest.raises(ServiceError, match="fork_server"):
                agent.request("heartbeat", {"host": "h1", "incarnation": "i", "fork_server": bad})
        assert {h["host"]: h["fork_server"] for h in agent.request("hosts").body["all"]}["h1"] == {
            "state": "unavailable",
            "reason": why,
        }, "kept"
    finally:
        agent.close()


def test_a_host_entry_answers_its_due_slots_once_and_gives_back_the_rest(rendezvous: RendezvousService) -> None:
    """One join per host: a resend is answered once, a newer join replaces the parked one, a slot the round removed
    is answered at once while the host's other slot goes back to its agent, bad slots are refused."""
    admin = Client(rendezvous.endpoint, "test-admin", timeout=1.0, deadline=2.0)
    agent = Client(rendezvous.endpoint, "agent-a", timeout=1.0, deadline=5.0)
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(rendezvous.endpoint)
    try:
        admin.request("new_round", {"hosts": [["a", 2], ["b", 1]], "min_np": 1, "hosts_timestamp": 1.0, "round": 1})
        for slots, code in (
            ([[2, 0, 7]], "no_such_slot"),
            ([[0, 0, 7], [0, 0, 8]], "bad_request"),
            ([[0, -1, 7]], "bad_request"),
            ("all", "bad_request"),
        ):
            with pytest.raises(ServiceError) as refused:
                agent.request("enter_round", {"host": "a", "slots": slots})
            assert refused.value.code == code, slots
        parked = Message(type="enter_round", body={"host": "a", "slots": [[0, 0, 10]]}, id="j-1", sender="agent-a")
        raw.send_multipart(encode(parked))
        raw.send_multipart(encode(parked))  # an agent's resend: the same id
        wait_for(lambda: ("a", 0) in rendezvous.rounds.parked, 5, "slot a:0 parked")
        raw.send_multipart(
            encode(
                Message(
                    type="enter_round",
                    body={"host": "a", "slots": [[0, 0, 10], [1, 0, 11]]},
                    id="j-2",
                    sender="agent-a",
                )
            )
        )
        replaced = decode(raw.recv_multipart())
        assert (replaced.id, replaced.body) == ("j-1", {"answers": []}), "the replaced join is answered, with nothing"
        (b,) = agent.request("enter_round", {"host": "b", "slots": [[0, 0, 20]]}).body["answers"]
        released = decode(raw.recv_multipart())
        assert released.id == "j-2" and sorted(a[:2] for a in released.body["answers"]) == [[0, 10], [1, 11]]
        assert b[2]["size"] == 3
        assert not raw.poll(200), "each join is answered once"
        # Round 2 lacks slot a:1 (down): it is answered at once, and a:0 (waiting for b:0) goes back to the agent.
        admin.request("new_round", {"hosts": [["a", [0]], ["b", 1]], "min_np": 1, "hosts_timestamp": 2.0, "round": 2})
        (removed,) = agent.request("enter_round", {"host": "a", "slots": [[0, 1, 10], [1, 1, 11]]}).body["answers"]
        assert removed == [1, 11, {"removed": True, "round": 2}]
        assert ("a", 0) not in rendezvous.rounds.parked, "the host's other slot goes back to its agent"
        raw.send_multipart(
            encode(Message(type="enter_round", body={"host": "a", "slots": [[0, 1, 10]]}, id="j-3", sender="agent-a"))
        )
        wait_for(lambda: ("a", 0) in rendezvous.rounds.parked, 5, "slot a:0 parked again")
        agent.request("enter_round", {"host": "b", "slots": [[0, 1, 20]]})
        (kept,) = decode(raw.recv_multipart()).body["answers"]
        assert kept[:2] == [0, 10] and kept[2]["round"] == 2 and kept[2]["size"] == 2
    finally:
        raw.close(linger=0)
        agent.close()
        admin.close()
