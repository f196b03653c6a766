"""Write, then apply (issue 45): a change the registry's store refuses is undone, so the request's retry finds the
registry as it was; and a driver pass whose save is refused is redone (issue 56). The refusal is real: another
connection holds SQLite's write lock on the registry's database past its busy timeout, as a backup tool or a stuck
process would."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.bus.config import Endpoints, Timing
from elastic_control_plane.bus.contract import Event
from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.discovery.service import DiscoveryService
from elastic_control_plane.services.notifier.service import NotifierService
from elastic_control_plane.services.registry import metrics
from elastic_control_plane.services.registry.service import RegistryService
from elastic_control_plane.services.registry.store import DATABASE, SqliteJobStore
from elastic_control_plane.services.rendezvous.service import RendezvousService
from testing.harness import free_ports, wait_for

BUSY_TIMEOUT_S = 0.5  # how long the registry's save waits for the lock before it is refused


class RunningRegistry:
    """A registry served in a thread of its own (its SQLite connection is that thread's), started again on demand."""

    def __init__(self, state_dir: Path, peers: Endpoints) -> None:
        self.state_dir, self.peers = state_dir, peers
        self.service: RegistryService | None = None
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        ready = threading.Event()

        def serve() -> None:
            store = SqliteJobStore(self.state_dir)
            store._db.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
            self.service = RegistryService(self.peers.registry, self.peers, Timing(), store)
            ready.set()
            try:
                self.service.run()
            finally:
                self.service.close()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10), "the registry did not start"

    def stop(self) -> None:
        if self.service is not None and self.thread is not None:
            self.service.stop()
            self.thread.join(timeout=10)
            assert not self.thread.is_alive(), "the registry did not stop"
        self.service = self.thread = None


@pytest.fixture
def registry(
    tmp_path: Path, notifier: NotifierService, discovery: DiscoveryService, rendezvous: RendezvousService
) -> Iterator[RunningRegistry]:
    peers = Endpoints(
        discovery=discovery.endpoint,
        rendezvous=rendezvous.endpoint,
        registry=f"tcp://127.0.0.1:{free_ports(1)[0]}",
        notifier=notifier.endpoint,
        events=notifier.events.sock.getsockopt_string(zmq.LAST_ENDPOINT),
    )
    running = RunningRegistry(tmp_path / "state", peers)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def submit(client: Client) -> dict[str, Any]:
    spec = JobSpec(command=["python", "train.py"], min_np=1).to_dict()
    return client.request("submit", {"spec": spec}).body


def test_a_submit_the_store_refused_is_undone_and_its_retry_is_the_same_job(registry: RunningRegistry) -> None:
    client = Client(registry.peers.registry, "test-operator", timeout=5.0, deadline=10.0)
    lock = sqlite3.connect(registry.state_dir / DATABASE, isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")
        with pytest.raises(ServiceError) as refused:
            submit(client)
        assert refused.value.code == "unavailable"
        assert client.request("job").body["state"] == "none", "the refused submission left no job behind"
        lock.execute("ROLLBACK")

        assert submit(client) == {"job": 1}, "the retry is the job the refusal undid, not `job_running`"
        assert client.request("job").body["state"] == "waiting"
        registry.stop()
        registry.start()
        restarted = client.request("job").body
        assert (restarted["job"], restarted["state"]) == (1, "waiting"), "restarted, it has the job it acknowledged"
    finally:
        lock.close()
        client.close()


def test_a_cancel_the_store_refused_leaves_the_job_running_and_its_retry_cancels(registry: RunningRegistry) -> None:
    client = Client(registry.peers.registry, "test-operator", timeout=5.0, deadline=10.0)
    lock = sqlite3.connect(registry.state_dir / DATABASE, isolation_level=None)
    try:
        assert submit(client) == {"job": 1}
        lock.execute("BEGIN IMMEDIATE")
        with pytest.raises(ServiceError) as refused:
            client.request("cancel", {"reason": "operator"})
        assert refused.value.code == "unavailable"
        assert client.request("job").body["state"] == "waiting", "the refused cancel was undone"
        lock.execute("ROLLBACK")
        cancelled = client.request("cancel", {"reason": "operator"}).body
        assert (cancelled["state"], cancelled["reason"]) == ("failed", "operator")
    finally:
        lock.close()
        client.close()


def test_a_pass_whose_save_the_store_refused_is_redone_and_its_round_announced_once(
    registry: RunningRegistry, discovery: DiscoveryService, notifier: NotifierService
) -> None:
    """The store refuses every save while the driver's pass starts round 1 (issue 56: etcd's leader stopped at a
    reset): no exception leaves the pass, memory goes back to the last save and each later pass asks for the same
    round again; once the store takes the save the round is the job's, and its event went out once."""
    client = Client(registry.peers.registry, "test-operator", timeout=5.0, deadline=10.0)
    agent = Client(discovery.endpoint, "test-agent", timeout=5.0, deadline=10.0)
    events = Client(notifier.endpoint, "test-reader", timeout=5.0, deadline=10.0)
    lock = sqlite3.connect(registry.state_dir / DATABASE, isolation_level=None)
    refused_before = metrics.PASSES_NOT_SAVED._value.get()
    try:
        assert submit(client) == {"job": 1}
        lock.execute("BEGIN IMMEDIATE")
        agent.request("register", {"host": "h1", "slots": 1, "incarnation": "i"})
        wait_for(lambda: metrics.PASSES_NOT_SAVED._value.get() >= refused_before + 3, 30, "three refused passes")
        assert client.request("job").body["round"] == 0, "a round whose save was refused is not the job's"
        assert registry.thread is not None and registry.thread.is_alive()
        lock.execute("ROLLBACK")
        wait_for(lambda: client.request("job").body["round"] == 1, 30, "round 1 saved once the store takes it")
        wait_for(lambda: round_events(events), 10, "round 1's event")
        assert [body["round"] for body in round_events(events)] == [1], "announced once"
    finally:
        lock.close()
        for each in (client, agent, events):
            each.close()


def round_events(events: Client) -> list[dict[str, Any]]:
    reply = events.request("since", {"seq": 0}).body
    return [body for event, body in reply["events"] if event == Event.ROUND]
