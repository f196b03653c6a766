"""A host is who its pod is (services/discovery/pod_identity.py): a real discovery, checking pod identities against
a loopback API server that answers TokenReviews as the real one does (testing/kube_apiserver.py), takes a host's
`register` only with a token of the agents' service account, for the audience, from the pod of the host's name.

Each attack beside its innocent twin: a token of agent-1's pod naming agent-0 is refused and agent-0's record, slots
and heartbeats are untouched, while the same token registers agent-1; a token for another audience, of another
service account, unknown, expired, of a deleted pod, or none is refused, and a good token then registers the same
new incarnation (a restarted agent). An API that cannot answer refuses retryably (`unavailable`, said once), and
discovery takes the host once the API heals. Heartbeats need no token; a (host, incarnation) is reviewed once."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.services.discovery.kubernetes import ApiServer
from elastic_control_plane.services.discovery.pod_identity import PodIdentity
from elastic_control_plane.services.discovery.service import DiscoveryService
from elastic_control_plane.services.notifier.service import NotifierService
from testing.harness import free_ports, serve_in_thread
from testing.kube_apiserver import TOKEN_REVIEW, KubeApiServer
from tests.sockets.test_kubernetes_discovery import RecordedLog

NAMESPACE, ACCOUNT, AUDIENCE = "ml", "elastic-agent", "elastic-discovery"


@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer(NAMESPACE)
    yield server
    server.close()


@pytest.fixture
def log() -> RecordedLog:
    return RecordedLog()


def discovery_checking(notifier: NotifierService, api_url: str, log: RecordedLog) -> Iterator[DiscoveryService]:
    identity = PodIdentity(ApiServer(api_url), NAMESPACE, ACCOUNT, AUDIENCE, log)
    endpoint = f"tcp://127.0.0.1:{free_ports(1)[0]}"
    yield from serve_in_thread(
        DiscoveryService(endpoint, notifier.endpoint, Timing(heartbeat=30.0), pod_identity=identity)
    )


@pytest.fixture
def discovery(notifier: NotifierService, api: KubeApiServer, log: RecordedLog) -> Iterator[DiscoveryService]:
    yield from discovery_checking(notifier, api.url, log)


@pytest.fixture
def agent(discovery: DiscoveryService) -> Iterator[Client]:
    client = Client(discovery.endpoint, "test-agent", timeout=2.0, deadline=10.0)
    yield client
    client.close()


def register(agent: Client, host: str, incarnation: str, token: str | None, down: list[int] | None = None) -> None:
    body: dict[str, Any] = {"host": host, "slots": 4, "incarnation": incarnation}
    body.update({"down": down, "down_version": 1} if down is not None else {})
    agent.request("register", {**body, **({"pod_token": token} if token is not None else {})})


def refused(agent: Client, host: str, incarnation: str, token: str | None) -> ServiceError:
    with pytest.raises(ServiceError) as refusal:
        register(agent, host, incarnation, token)
    return refusal.value


def record(agent: Client, host: str) -> dict[str, Any]:
    return next(row for row in agent.request("hosts").body["all"] if row["host"] == host)


def heartbeat(agent: Client, host: str, incarnation: str) -> str:
    return str(agent.request("heartbeat", {"host": host, "incarnation": incarnation}).body["status"])


def nothing_logged(log: RecordedLog, *tokens: str) -> None:
    """No line says a token."""
    for _, event, fields in log.lines:
        assert not any(token in repr(fields) for token in tokens), f"{event} logged a token"


def test_a_token_of_one_pod_registers_its_own_host_and_never_another(
    api: KubeApiServer, agent: Client, log: RecordedLog, capfd: pytest.CaptureFixture[str]
) -> None:
    victim = api.tokens.issue("agent-0", AUDIENCE, ACCOUNT, node="node-a")
    register(agent, "agent-0", "agent-0-1", victim, down=[2])
    before = record(agent, "agent-0")
    assert (before["slots"], before["down"], before["incarnation"]) == (4, [2], "agent-0-1")

    intruder = api.tokens.issue("agent-1", AUDIENCE, ACCOUNT, node="node-b")
    refusal = refused(agent, "agent-0", "intruder-1", intruder)
    assert refusal.code == "forbidden" and "'agent-1'" in refusal.message
    assert record(agent, "agent-0") == before, "the victim's record and slots untouched"
    assert heartbeat(agent, "agent-0", "agent-0-1") == "ok", "the victim goes on"
    [line] = log.said("pod_identity_refused")
    assert line["host"] == "agent-0" and "pod 'agent-1'" in line["reason"]

    reviews = api.count(TOKEN_REVIEW)
    assert refused(agent, "agent-0", "intruder-1", intruder).code == "forbidden", "its retry too"
    assert api.count(TOKEN_REVIEW) == reviews and len(log.said("pod_identity_refused")) == 1, "from memory, unsaid"

    register(agent, "agent-1", "agent-1-1", intruder)  # the innocent twin: the same token, its own host
    assert record(agent, "agent-1")["incarnation"] == "agent-1-1"
    assert [(line["host"], line["node"]) for line in log.said("pod_identity_proven")] == [
        ("agent-0", "node-a"),
        ("agent-1", "node-b"),
    ]
    nothing_logged(log, victim, intruder)
    said = capfd.readouterr()
    assert victim not in said.out + said.err and intruder not in said.out + said.err, "the service's own lines neither"


def _deleted_pods_token(api: KubeApiServer) -> str:
    api.add_pod("agent-0", {"app": "elastic"})
    token = api.tokens.issue("agent-0", AUDIENCE, ACCOUNT)
    api.delete_pod("agent-0")
    return token


def _expired_token(api: KubeApiServer) -> str:
    token = api.tokens.issue("agent-0", AUDIENCE, ACCOUNT)
    api.tokens.expire(token)
    return token


BAD_TOKENS: dict[str, tuple[Callable[[KubeApiServer], str | None], str]] = {  # how made, what the refusal says
    "another audience": (lambda api: api.tokens.issue("agent-0", "another-audience", ACCOUNT), "target audiences"),
    "another service account": (lambda api: api.tokens.issue("agent-0", AUDIENCE, "default"), ":default'"),
    "unknown": (lambda api: "a-token-the-api-never-issued", "could not be validated"),
    "expired": (_expired_token, "invalidated"),
    "a deleted pod's": (_deleted_pods_token, "invalidated"),
    "none": (lambda api: None, "no pod token"),
}


@pytest.mark.parametrize("kind", sorted(BAD_TOKENS))
def test_a_register_without_its_pods_token_is_refused_and_the_pods_own_is_taken(
    api: KubeApiServer, agent: Client, log: RecordedLog, kind: str
) -> None:
    register(agent, "agent-0", "agent-0-1", api.tokens.issue("agent-0", AUDIENCE, ACCOUNT))
    before = record(agent, "agent-0")
    make, says = BAD_TOKENS[kind]
    bad = make(api)
    refusal = refused(agent, "agent-0", "agent-0-2", bad)
    assert refusal.code == "forbidden" and says in refusal.message, refusal.message
    assert record(agent, "agent-0") == before and heartbeat(agent, "agent-0", "agent-0-1") == "ok"
    [line] = log.said("pod_identity_refused")
    assert line["host"] == "agent-0" and says in line["reason"]

    register(agent, "agent-0", "agent-0-2", api.tokens.issue("agent-0", AUDIENCE, ACCOUNT))  # restarted, its own
    assert record(agent, "agent-0")["incarnation"] == "agent-0-2"
    nothing_logged(log, *([bad] if bad else []))


def test_a_restarted_agent_is_reviewed_once_and_heartbeats_need_no_token(api: KubeApiServer, agent: Client) -> None:
    register(agent, "agent-0", "agent-0-1", api.tokens.issue("agent-0", AUDIENCE, ACCOUNT))
    for _ in range(3):
        assert heartbeat(agent, "agent-0", "agent-0-1") == "ok"
    register(agent, "agent-0", "agent-0-1", None)  # the same incarnation again (a heartbeat said unknown): proven
    assert api.count(TOKEN_REVIEW) == 1, "one review for the (host, incarnation)"
    register(agent, "agent-0", "agent-0-2", api.tokens.issue("agent-0", AUDIENCE, ACCOUNT))  # a new incarnation
    assert api.count(TOKEN_REVIEW) == 2 and record(agent, "agent-0")["incarnation"] == "agent-0-2"
    assert heartbeat(agent, "agent-0", "agent-0-1") != "ok", "the old incarnation is gone"


def test_an_api_that_cannot_answer_refuses_retryably_once_said_and_heals(
    api: KubeApiServer, agent: Client, log: RecordedLog
) -> None:
    token = api.tokens.issue("agent-0", AUDIENCE, ACCOUNT)
    api.fail(503, times=None, verbs=(TOKEN_REVIEW,))
    for _ in range(3):
        refusal = refused(agent, "agent-0", "agent-0-1", token)
        assert refusal.code == "unavailable" and "503" in refusal.message
    assert agent.request("ping").body is not None, "discovery alive"
    assert len(log.said("pod_identity_unavailable")) == 1, "said once per outage"
    assert log.said("pod_identity_refused") == [], "not the agent's fault"
    api.heal()
    register(agent, "agent-0", "agent-0-1", token)
    assert record(agent, "agent-0")["incarnation"] == "agent-0-1"
    assert len(log.said("pod_identity_recovered")) == 1
    nothing_logged(log, token)


@pytest.fixture
def unreachable(notifier: NotifierService, log: RecordedLog) -> Iterator[DiscoveryService]:
    """Discovery checking identities with an API where nothing listens."""
    yield from discovery_checking(notifier, f"http://127.0.0.1:{free_ports(1)[0]}", log)


def test_an_unreachable_api_refuses_retryably(unreachable: DiscoveryService, log: RecordedLog) -> None:
    client = Client(unreachable.endpoint, "test-agent", timeout=2.0, deadline=10.0)
    try:
        refusal = refused(client, "agent-0", "agent-0-1", "some-token")
        assert refusal.code == "unavailable" and "did not answer" in refusal.message
        assert [line["host"] for line in log.said("pod_identity_unavailable")] == ["agent-0"]
    finally:
        client.close()
