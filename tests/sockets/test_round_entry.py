"""A host's way into a round (agent/round_entry.py) against the real rendezvous: the workers of a host ask their
agent one by one, the rendezvous sees the host's entries, not one request per slot; a round key is looked up once.

`EntryHost` is the agent's side of it, as agent/agent.py wires it (its handlers and its tick), in a service of its
own so that the test can count what reaches the rendezvous."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from elastic_control_plane.agent.round_entry import HostEntry, RoundKeyLookups
from elastic_control_plane.bus.client import AsyncClient, Client, ServiceError, Unreachable
from elastic_control_plane.bus.metrics import MESSAGES
from elastic_control_plane.bus.service import DEFERRED, Request, Service, handles
from elastic_control_plane.services.rendezvous.service import RendezvousService
from testing.harness import free_ports, serve_in_thread, wait_for


class EntryHost(Service):
    name = "entry-host"

    def __init__(self, endpoint: str, rendezvous: str, host: str, slots: int, live: set[int]) -> None:
        super().__init__(endpoint)
        client = AsyncClient(self, rendezvous, f"agent-{host}")
        self.ranked: list[int] = []
        self.entry = HostEntry(host, slots, client, lambda: live, self.ranked.append)
        self.lookups = RoundKeyLookups(host, client)
        self.every(0.05, self.entry.tick)

    @handles("rank_and_size")
    def on_rank_and_size(self, request: Request) -> Any:
        self.entry.ask(request)
        return DEFERRED

    @handles("kv_get")
    def on_kv_get(self, request: Request) -> Any:
        self.lookups.get(request)
        return DEFERRED

    @handles("job_round")
    def on_job_round(self, request: Request) -> Any:
        """What the agent does on a `round` event of a job (agent/agent.py)."""
        self.lookups.job_round(request.body["job_key"])
        return {}


def handled(msg_type: str) -> float:
    return MESSAGES.labels("rendezvous", msg_type, "handled")._value.get()


def host(rendezvous: RendezvousService, name: str, slots: int, live: set[int]) -> Iterator[EntryHost]:
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    yield from serve_in_thread(EntryHost(endpoint, rendezvous.endpoint, name, slots, live))  # type: ignore[misc]


def ask_in_threads(
    endpoint: str, asks: list[dict[str, Any]], answers: dict[int, Any], deadline: float = 20.0
) -> list[threading.Thread]:
    def ask(body: dict[str, Any]) -> None:
        client = Client(endpoint, f"worker-{body['pid']}", timeout=1.0, deadline=deadline)
        try:
            answers[body["local_rank"]] = client.request("rank_and_size", body).body
        except ServiceError as exc:
            answers[body["local_rank"]] = exc.code
        except Unreachable:
            answers[body["local_rank"]] = "no answer"
        finally:
            client.close()

    threads = [threading.Thread(target=ask, args=(body,)) for body in asks]
    for thread in threads:
        thread.start()
    return threads


def test_four_workers_of_a_host_enter_in_at_most_two_entries_and_read_the_store_address_once(
    rendezvous: RendezvousService,
) -> None:
    admin = Client(rendezvous.endpoint, "test-admin", timeout=1.0, deadline=5.0)
    hosts = host(rendezvous, "a", 4, {0, 1, 2, 3})
    agent = next(hosts)
    try:
        admin.request("new_round", {"hosts": [["a", 4]], "min_np": 4, "hosts_timestamp": 1.0, "round": 1})
        entries = handled("enter_round")
        answers: dict[int, Any] = {}
        asks = [{"local_rank": lr, "after_round": 0, "pid": 100 + lr} for lr in range(4)]
        for thread in ask_in_threads(agent.endpoint, asks, answers):
            thread.join(timeout=20)
        assert sorted((lr, a["rank"], a["size"]) for lr, a in answers.items()) == [(i, i, 4) for i in range(4)]
        assert sorted(agent.ranked) == [0, 1, 2, 3]
        # The first worker's ask goes out at once; the others' in the entry that replaces it (when all four wait).
        assert handled("enter_round") - entries <= 2, "the host entered once or twice, not once per worker"

        admin.request("kv_set", {"key": "round/1/store", "host": "a"}, raw=(b"10.0.0.1:29500",))
        lookups = handled("kv_get")
        readers = [Client(agent.endpoint, f"reader-{i}", timeout=1.0, deadline=5.0) for i in range(4)]
        try:
            read = [r.request("kv_get", {"key": "round/1/store"}).raw for r in readers]
        finally:
            for reader in readers:
                reader.close()
        assert read == [(b"10.0.0.1:29500",)] * 4
        assert handled("kv_get") - lookups == 1, "the store address is looked up once for the host"
    finally:
        hosts.close()
        admin.close()


def test_a_slot_the_host_lacks_is_refused_and_a_worker_that_exits_is_withdrawn(rendezvous: RendezvousService) -> None:
    admin = Client(rendezvous.endpoint, "test-admin", timeout=1.0, deadline=5.0)
    hosts = host(rendezvous, "a", 2, {0, 1})
    agent = next(hosts)
    try:
        admin.request("new_round", {"hosts": [["a", 2]], "min_np": 2, "hosts_timestamp": 1.0, "round": 1})
        refused: dict[int, Any] = {}
        for thread in ask_in_threads(agent.endpoint, [{"local_rank": 2, "after_round": 0, "pid": 7}], refused):
            thread.join(timeout=10)
        assert refused == {2: "no_such_slot"}

        waiting: dict[int, Any] = {}
        (worker,) = ask_in_threads(agent.endpoint, [{"local_rank": 0, "after_round": 0, "pid": 100}], waiting, 3.0)
        wait_for(lambda: ("a", 0) in rendezvous.rounds.parked, 10, "slot a:0 parked at the rendezvous")
        agent.entry.drop(0, 100)  # the worker exited: the agent's next tick withdraws its entry
        wait_for(lambda: not rendezvous.rounds.parked and not rendezvous.host_entries, 10, "the entry withdrawn")
        wait_for(lambda: agent.entry.parked_id is None, 10, "the withdrawal answered")
        worker.join(timeout=10)
        assert waiting == {0: "no answer"}, "a worker that exited is answered nothing"
    finally:
        hosts.close()
        admin.close()


def test_the_next_jobs_round_1_reads_its_own_store_address_not_the_one_before_it(rendezvous: RendezvousService) -> None:
    """Round numbers start again with each job: job 2's round 1 once got job 1's round-1 store address from the
    agent's values and its ranks waited 40 s on a dead store."""
    admin = Client(rendezvous.endpoint, "test-admin", timeout=1.0, deadline=5.0)
    hosts = host(rendezvous, "a", 1, {0})
    agent = next(hosts)
    reader = Client(agent.endpoint, "reader", timeout=1.0, deadline=5.0)
    try:
        for job_key, address in (("job-1", b"127.0.0.1:1111"), ("job-2", b"127.0.0.1:2222")):
            reader.request("job_round", {"job_key": job_key})
            admin.request("new_round", {"hosts": [["a", 1]], "min_np": 1, "hosts_timestamp": 1.0, "round": 1})
            admin.request("kv_set", {"key": "round/1/store", "host": "a"}, raw=(address,))
            assert reader.request("kv_get", {"key": "round/1/store"}).raw == (address,), job_key
        reader.request("job_round", {"job_key": "job-2"})
        lookups = handled("kv_get")
        assert reader.request("kv_get", {"key": "round/1/store"}).raw == (b"127.0.0.1:2222",)
        assert handled("kv_get") == lookups, "within a job, a round's key is still looked up once"
    finally:
        reader.close()
        hosts.close()
        admin.close()
