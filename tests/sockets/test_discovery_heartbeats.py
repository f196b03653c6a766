"""Discovery's heartbeats through real sockets: reports a heartbeat repeats are kept as they are, a changed or
malformed one is checked again, and the answers (ok, unknown, lost) are those of the host set."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.services.discovery.service import DiscoveryService

SNAPSHOT = {"commit": 4, "bytes": 1024, "written_at": 2.0}
FORK_SERVER = {"state": "ready", "reason": ""}


@pytest.fixture
def agent(discovery: DiscoveryService) -> Iterator[Client]:
    client = Client(discovery.endpoint, "test-agent", timeout=2.0, deadline=5.0)
    yield client
    client.close()


def beat(agent: Client, **reports: object) -> str:
    return str(agent.request("heartbeat", {"host": "h1", "incarnation": "i", **reports}).body["status"])


def test_repeated_reports_are_kept_as_they_are_and_a_changed_one_replaces_them(
    discovery: DiscoveryService, agent: Client
) -> None:
    agent.request("register", {"host": "h1", "slots": 2, "incarnation": "i"})
    assert beat(agent, snapshot=SNAPSHOT, fork_server=FORK_SERVER) == "ok"
    record = discovery.hostset.hosts["h1"]
    kept_snapshots, kept_fork_server = record.snapshots, record.fork_server
    for _ in range(3):
        assert beat(agent, snapshot=SNAPSHOT, fork_server=FORK_SERVER) == "ok"
    assert record.snapshots is kept_snapshots and record.fork_server is kept_fork_server, "not checked or copied again"
    assert beat(agent, snapshot={**SNAPSHOT, "commit": 5}, fork_server=FORK_SERVER) == "ok"
    shown = next(h for h in agent.request("hosts").body["all"] if h["host"] == "h1")
    assert shown["snapshot"] == {**SNAPSHOT, "commit": 5}
    assert shown["fork_server"] == FORK_SERVER
    assert beat(agent) == "ok"
    shown = next(h for h in agent.request("hosts").body["all"] if h["host"] == "h1")
    assert (shown["snapshot"], shown["fork_server"]) == (None, None), "an agent that stops reporting shows none"


def test_a_malformed_report_is_refused_whether_or_not_the_host_is_known(agent: Client) -> None:
    with pytest.raises(ServiceError, match="snapshot"):
        beat(agent, snapshot={"commit": -1, "bytes": 0, "written_at": 0.0})
    agent.request("register", {"host": "h1", "slots": 2, "incarnation": "i"})
    assert beat(agent, snapshot=SNAPSHOT) == "ok"
    with pytest.raises(ServiceError, match="snapshot"):
        beat(agent, snapshot={**SNAPSHOT, "bytes": "big"})
    shown = next(h for h in agent.request("hosts").body["all"] if h["host"] == "h1")
    assert shown["snapshot"] == SNAPSHOT, "kept"


def test_heartbeats_answer_unknown_for_another_incarnation_and_warm_a_host(
    discovery: DiscoveryService, agent: Client
) -> None:
    agent.request("register", {"host": "h1", "slots": 2, "incarnation": "i", "warm": False})
    assert agent.request("heartbeat", {"host": "h1", "incarnation": "other"}).body["status"] == "unknown"
    assert agent.request("heartbeat", {"host": "h2", "incarnation": "i"}).body["status"] == "unknown"
    assert not discovery.hostset.hosts["h1"].warm
    assert beat(agent, warm=True) == "ok"
    assert discovery.hostset.hosts["h1"].warm


def test_the_brief_host_list_is_sent_again_only_when_it_changed(agent: Client) -> None:
    """The registry reads the brief list every tick: asked with the generation it holds, an unchanged list is not
    sent again; a registration (a new list) is, under a new generation."""
    agent.request("configure", {"cooldown": [600, 600]})
    agent.request("register", {"host": "h1", "slots": 2, "incarnation": "i"})
    first = agent.request("hosts", {"brief": True}).body
    assert first["agents"] == {"h1": "i"} and "generation" in first
    unchanged = agent.request("hosts", {"brief": True, "unless": first["generation"]}).body
    assert unchanged == {"unchanged": True, "generation": first["generation"]}
    agent.request("register", {"host": "h2", "slots": 2, "incarnation": "j"})
    changed = agent.request("hosts", {"brief": True, "unless": first["generation"]}).body
    assert changed["agents"] == {"h1": "i", "h2": "j"} and changed["generation"] != first["generation"]
    stranger = agent.request("hosts", {"brief": True, "unless": ["another discovery", 1]}).body
    assert stranger["agents"] == changed["agents"], "a generation of another incarnation gets the whole list"
    agent.request("blacklist", {"host": "h2", "reason": "a worker failed"})
    marked = agent.request("hosts", {"brief": True, "unless": changed["generation"]}).body
    assert [row["host"] for row in marked["marked"]] == ["h2"] and marked["marked"][0]["cooldown_left"] is not None
    again = agent.request("hosts", {"brief": True, "unless": marked["generation"]}).body
    assert again.get("unchanged"), "a cooldown's seconds running down do not make a new list"


def test_snapshots_names_each_live_hosts_commit_and_whether_a_host_is_usable(agent: Client) -> None:
    """What the registry reads to judge a round: not the full host list."""
    agent.request("configure", {})
    agent.request("register", {"host": "h1", "slots": 2, "incarnation": "i", "snapshot": SNAPSHOT})
    agent.request("register", {"host": "h2", "slots": 2, "incarnation": "j"})
    assert agent.request("snapshots").body["commits"] == {"h1": 4} and agent.request("snapshots").body["usable"]
    agent.request("blacklist", {"host": "h1", "reason": "a worker failed"})
    assert agent.request("snapshots").body["usable"], "h2 is still usable"
    agent.request("blacklist", {"host": "h2", "reason": "a worker failed"})
    assert not agent.request("snapshots").body["usable"]


@pytest.mark.parametrize("slots", [0, 1025, 2**40])
def test_a_host_offering_no_slots_or_more_than_1024_is_refused_and_nothing_is_kept(
    discovery: DiscoveryService, agent: Client, slots: int
) -> None:
    with pytest.raises(ServiceError) as refused:
        agent.request("register", {"host": "greedy", "slots": slots, "incarnation": "i"})
    assert refused.value.code == "bad_request" and "slots must be 1 to 1024" in str(refused.value)
    assert "greedy" not in discovery.hostset.hosts
