"""Discovery taking its hosts from the Kubernetes API (a loopback API server, testing/kube_apiserver.py, which counts
the requests it gets): a pod made Ready is available within a second of the event, a pod deleted or being deleted
leaves, a watch cut off resumes where it was with no event lost, a 410 lists again, and a 403, an unreachable API
and a selector that matches nothing are each said once.

Then the client's retries, as client-go's reflector does them (services/discovery/kubernetes_retry.py): a
Retry-After is waited out (a long one capped), 5xx are backed off with jitter, a watch that ends or fails is watched
again from its resourceVersion and nothing is listed again, but for a 410 or a watch that failed 3 times in a row;
a long list comes in pages; a 401 and a 403 are each said as such; a healthy watch with bookmarks is listed once."""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_control_plane.bus.client import Client, ServiceError
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.services.discovery.kubernetes import READ_TIMEOUT, WATCH_SECONDS, ApiServer, PodSource
from elastic_control_plane.services.discovery.kubernetes_retry import Backoff, RetryPolicy
from elastic_control_plane.services.discovery.service import DiscoveryService
from elastic_control_plane.services.notifier.service import NotifierService
from testing.harness import free_ports, serve_in_thread, wait_for
from testing.kube_apiserver import Call, KubeApiServer

NAMESPACE = "ml"
SELECTOR = "app=elastic,tier=worker"
LABELS = {"app": "elastic", "tier": "worker"}
EVENT_TO_ROUND = 1.0  # seconds from a pod's event to its host in the job's next round (issue 34)
FAST_RETRY = RetryPolicy(first=0.05, cap=0.2)


class RecordedLog:
    """What the pod source says: (level, event, fields) per line."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append(("warning", event, fields))

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append(("info", event, fields))

    def said(self, event: str) -> list[dict[str, Any]]:
        return [fields for _, name, fields in list(self.lines) if name == event]


@pytest.fixture
def api() -> Iterator[KubeApiServer]:
    server = KubeApiServer(NAMESPACE, bookmark_every=0.1)
    yield server
    server.close()


@pytest.fixture
def log() -> RecordedLog:
    return RecordedLog()


def pod_source(
    api: KubeApiServer,
    log: RecordedLog,
    selector: str = SELECTOR,
    url: str = "",
    backoff: Backoff | None = None,
    watch_seconds: tuple[int, int] = (2, 3),
    read_timeout: float = 4.0,
) -> PodSource:
    """A pod source of quick watches and retries (`backoff`: FAST_RETRY's unless given)."""
    return PodSource(
        ApiServer(url or api.url),
        NAMESPACE,
        selector,
        log,
        watch_seconds=watch_seconds,
        read_timeout=read_timeout,
        backoff=backoff or Backoff(FAST_RETRY),
    )


def watches_from(api: KubeApiServer, resource_version: str | None) -> int:
    """How many watches the API server was asked for from this resourceVersion."""
    return sum(1 for call in list(api.calls) if call.verb == "watch" and call.resource_version == resource_version)


@pytest.fixture
def discovery(notifier: NotifierService, api: KubeApiServer, log: RecordedLog) -> Iterator[DiscoveryService]:
    service = DiscoveryService(
        f"tcp://127.0.0.1:{free_ports(1)[0]}", notifier.endpoint, Timing(heartbeat=30.0), pods=pod_source(api, log)
    )
    yield from serve_in_thread(service)  # type: ignore[misc]


@pytest.fixture
def agent(discovery: DiscoveryService) -> Iterator[Client]:
    client = Client(discovery.endpoint, "test-agent", timeout=2.0, deadline=5.0)
    client.request("configure", {"cooldown": [600, 600]})
    yield client
    client.close()


def available(agent: Client) -> dict[str, list[int]]:
    return {name: slots for name, slots in agent.request("hosts").body["available"]}


def register(agent: Client, *hosts: str, slots: int = 4) -> None:
    for host in hosts:
        agent.request("register", {"host": host, "slots": slots, "incarnation": f"{host}-1"})


def within(agent: Client, expected: dict[str, list[int]], seconds: float = EVENT_TO_ROUND) -> None:
    wait_for(lambda: available(agent) == expected, seconds, f"available hosts {expected}", interval=0.01)


def test_a_ready_pod_is_available_within_a_second_and_leaves_when_deleted_or_deleting(
    api: KubeApiServer, agent: Client
) -> None:
    register(agent, "worker-0", "worker-1", "worker-2", "stranger")
    wait_for(lambda: api.calls[-1:] and api.calls[-1].verb == "watch", 5, "the pod source watching")
    assert available(agent) == {}, "no registered agent is usable before its pod is listed and Ready"
    api.add_pod("worker-0", LABELS, gpus=2)
    api.add_pod("worker-1", LABELS, annotations={"elastic/slots": "3"})
    api.add_pod("worker-2", LABELS)
    api.add_pod("stranger", {"app": "elastic", "tier": "control"})
    api.set_ready("stranger", True)
    assert available(agent) == {}, "not Ready yet"
    api.set_ready("worker-0", True)
    within(agent, {"worker-0": [0, 1]})
    api.set_ready("worker-1", True)
    api.set_ready("worker-2", True)
    within(agent, {"worker-0": [0, 1], "worker-1": [0, 1, 2], "worker-2": [0, 1, 2, 3]})
    api.mark_deleting("worker-1")
    within(agent, {"worker-0": [0, 1], "worker-2": [0, 1, 2, 3]})
    api.delete_pod("worker-2")
    within(agent, {"worker-0": [0, 1]})
    api.set_ready("worker-0", False)
    within(agent, {})


def test_a_pod_ready_before_its_agent_registers_is_available_when_it_does(
    api: KubeApiServer, discovery: DiscoveryService, agent: Client
) -> None:
    api.add_pod("worker-0", LABELS)
    api.set_ready("worker-0", True)
    wait_for(lambda: discovery.pods and discovery.pods.hosts() == {"worker-0": None}, 5, "worker-0 listed")
    register(agent, "worker-0")
    assert available(agent) == {"worker-0": [0, 1, 2, 3]}


def test_cut_streams_resume_from_the_last_resource_version_with_no_event_lost(
    api: KubeApiServer, agent: Client
) -> None:
    register(agent, *(f"worker-{i}" for i in range(6)))
    for i in range(6):
        api.add_pod(f"worker-{i}", LABELS, gpus=1)
    for i in range(3):
        api.set_ready(f"worker-{i}", True)
    within(agent, {f"worker-{i}": [0] for i in range(3)})
    for i in range(3, 6):
        watches = api.count("watch")
        api.cut_streams()
        api.set_ready(f"worker-{i}", True)  # while no watch is open, or racing the new one
        wait_for(lambda n=watches: api.count("watch") > n, 5, "a new watch", interval=0.01)
    api.delete_pod("worker-0")
    within(agent, {f"worker-{i}": [0] for i in range(1, 6)})
    assert api.count("list") == 1, f"resumed by watching again, never listed again: {api.calls}"
    resumed = [call.resource_version or "" for call in api.calls if call.verb == "watch"]
    assert resumed == sorted(resumed, key=int) and len(resumed) >= 4


def test_bookmarks_carry_the_resource_version_past_events_of_other_pods(api: KubeApiServer, log: RecordedLog) -> None:
    source = pod_source(api, log)
    source.start()
    try:
        wait_for(lambda: source.hosts() == {}, 5, "the first list")
        for i in range(3):
            api.add_pod(f"control-{i}", {"app": "elastic", "tier": "control"})  # not the selector's: never sent
        last = api.pod_list("")["metadata"]["resourceVersion"]
        wait_for(lambda: source.resource_version == last, 5, "a bookmark at the last version", interval=0.01)
        api.cut_streams()
        wait_for(lambda: watches_from(api, last), 5, "a watch resumed from the bookmark", interval=0.01)
        assert source.hosts() == {} and api.count("list") == 1
    finally:
        source.stop()


def test_a_silent_watch_is_watched_again_from_where_it_was(api: KubeApiServer, log: RecordedLog) -> None:
    api.bookmark_every = None
    source = pod_source(api, log, watch_seconds=(60, 60), read_timeout=0.2)
    api.add_pod("worker-0", LABELS)
    api.set_ready("worker-0", True)
    source.start()
    try:
        wait_for(lambda: source.hosts() == {"worker-0": None}, 5, "worker-0")
        since = source.resource_version
        wait_for(lambda: watches_from(api, since) >= 3, 5, "watched again after silences", interval=0.01)
        api.delete_pod("worker-0")
        wait_for(lambda: source.hosts() == {}, 1, "worker-0 gone")
        assert api.count("list") == 1 and log.lines == []
    finally:
        source.stop()


def test_a_410_lists_again_and_the_hosts_are_those_of_the_new_list(
    api: KubeApiServer, agent: Client, log: RecordedLog
) -> None:
    register(agent, "worker-0", "worker-1", "worker-2")
    for name in ("worker-0", "worker-1"):
        api.add_pod(name, LABELS)
        api.set_ready(name, True)
    within(agent, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]})
    api.delete_pod("worker-0")
    api.compact()  # the open watch ends with an ERROR event of code 410
    wait_for(lambda: len(log.said("kubernetes_relist")) == 1, 5, "a relist", interval=0.01)
    within(agent, {"worker-1": [0, 1, 2, 3]})
    api.gone_over_http = True
    api.add_pod("worker-2", LABELS)
    api.set_ready("worker-2", True)
    api.compact()  # the open watch breaks off, and the one that resumes it is answered HTTP 410
    wait_for(lambda: len(log.said("kubernetes_relist")) == 2, 5, "a relist after HTTP 410", interval=0.01)
    within(agent, {"worker-1": [0, 1, 2, 3], "worker-2": [0, 1, 2, 3]})
    assert api.count("list") == 3
    assert log.said("kubernetes_forbidden") == log.said("kubernetes_unreachable") == []


def test_a_forbidden_watch_is_said_once_naming_the_verb_and_watched_again_from_where_it_was(
    api: KubeApiServer, agent: Client, log: RecordedLog
) -> None:
    register(agent, "worker-0")
    api.add_pod("worker-0", LABELS)
    api.set_ready("worker-0", True)
    within(agent, {"worker-0": [0, 1, 2, 3]})
    api.fail(403, times=None)
    api.cut_streams()
    wait_for(lambda: [call.verb for call in api.calls[-4:]] == ["watch"] * 4, 5, "refused watches", interval=0.01)
    assert [fields["reason"] for fields in log.said("kubernetes_forbidden")] == [
        f"the service account may not watch pods in namespace {NAMESPACE} (RBAC: pods get, list, watch)"
    ], "one line per outage, naming the verb"
    assert available(agent) == {"worker-0": [0, 1, 2, 3]}, "the last hosts listed stay in force"
    assert api.count("list") == 1, "a list would be refused as the watch is: watched again, not listed"
    api.delete_pod("worker-0")
    api.heal()
    within(agent, {}, seconds=2.0)
    assert len(log.said("kubernetes_recovered")) == 1 and len(log.said("kubernetes_forbidden")) == 1


def test_a_selector_matching_nothing_is_said_once(api: KubeApiServer, log: RecordedLog) -> None:
    source = pod_source(api, log, selector="app=nothing-here")
    source.start()
    try:
        wait_for(lambda: source.hosts() == {}, 5, "the first list")
        for i in range(3):
            api.add_pod(f"other-{i}", LABELS)
            api.compact()
            wait_for(lambda n=i: api.count("list") == n + 2, 5, "a list", interval=0.01)
        assert [fields["selector"] for fields in log.said("kubernetes_no_pods")] == ["app=nothing-here"]
    finally:
        source.stop()


@pytest.fixture
def hangup() -> Iterator[tuple[str, list[int]]]:
    """An API address that accepts connections and hangs up at once, and how many it accepted."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            accepted.append(1)
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", accepted
    listener.shutdown(socket.SHUT_RDWR)
    listener.close()
    thread.join(timeout=5)


def test_an_unreachable_api_is_said_once_and_no_host_is_usable(
    notifier: NotifierService, api: KubeApiServer, log: RecordedLog, hangup: tuple[str, list[int]]
) -> None:
    url, accepted = hangup
    source = pod_source(api, log, url=url)
    service = DiscoveryService(
        f"tcp://127.0.0.1:{free_ports(1)[0]}", notifier.endpoint, Timing(heartbeat=30.0), pods=source
    )
    for running in serve_in_thread(service):
        client = Client(running.endpoint, "test-agent", timeout=2.0, deadline=5.0)
        try:
            register(client, "worker-0")
            wait_for(lambda: len(accepted) >= 3, 5, "three tries")
            assert source.hosts() is None and available(client) == {}
            assert [event for _, event, _ in log.lines] == ["kubernetes_unreachable"]
        finally:
            client.close()


def test_a_job_that_names_a_discovery_script_is_refused_where_pods_are_watched(agent: Client) -> None:
    with pytest.raises(ServiceError, match="may not name a discovery script"):
        agent.request("configure", {"discovery_script": "/bin/true"})


# -- the client's retries ----------------------------------------------------------------------
SLACK = 0.5  # seconds a retry may come later than its wait: a loaded machine's scheduling


def ready(api: KubeApiServer, *names: str) -> None:
    for name in names:
        api.add_pod(name, LABELS)
        api.set_ready(name, True)


@pytest.fixture
def start(api: KubeApiServer, log: RecordedLog) -> Iterator[Callable[..., PodSource]]:
    """Start a pod source (pod_source's options); each is stopped after the test."""
    sources: list[PodSource] = []

    def started(**options: Any) -> PodSource:
        source = pod_source(api, log, **options)
        source.start()
        sources.append(source)
        return source

    yield started
    for source in sources:
        source.stop()


def watching(api: KubeApiServer, source: PodSource) -> str:
    """Wait until `source` watches from its resourceVersion; that resourceVersion."""
    wait_for(
        lambda: api.calls[-1:] and api.calls[-1].verb == "watch" and source.resource_version is not None,
        5,
        "a watch",
        interval=0.01,
    )
    return wait_for(lambda: source.resource_version, 5, "a resourceVersion")


def calls_after(api: KubeApiServer, seen: int, count: int) -> list[Call]:
    """Wait for `count` requests after the first `seen`; those."""
    wait_for(lambda: len(api.calls) >= seen + count, 10, f"{count} requests after {seen}", interval=0.01)
    return api.calls[seen : seen + count]


def events(log: RecordedLog) -> list[str]:
    return [event for _, event, _ in list(log.lines)]


def test_a_healthy_watch_with_bookmarks_is_listed_once_and_watched_again_from_each_bookmark(
    api: KubeApiServer, log: RecordedLog, start: Callable[..., PodSource]
) -> None:
    ready(api, "worker-0")
    source = start(watch_seconds=WATCH_SECONDS, read_timeout=READ_TIMEOUT)
    wait_for(lambda: source.hosts() == {"worker-0": None}, 5, "worker-0 listed")
    for i in range(3):
        api.add_pod(f"control-{i}", {"app": "elastic", "tier": "control"})  # not the selector's: only a bookmark
        latest = api.pod_list("")["metadata"]["resourceVersion"]
        wait_for(lambda: source.resource_version == latest, 5, "a bookmark at the latest version", interval=0.01)
        api.end_streams()  # as the API does at the watch's timeoutSeconds
        wait_for(lambda: watches_from(api, latest), 5, "a watch from the bookmark", interval=0.01)
    ready(api, "worker-1")
    wait_for(lambda: source.hosts() == {"worker-0": None, "worker-1": None}, 5, "worker-1 watched")
    watches = [call for call in api.calls if call.verb == "watch"]
    assert api.count("list") == 1 and api.count("continue") == 0 and len(watches) == 4, api.calls
    assert all(call.query["allowWatchBookmarks"] == "true" for call in watches)
    assert all(60 <= int(call.query["timeoutSeconds"]) <= 80 for call in watches)
    assert log.lines == [], "nothing to say"


def test_a_429_s_retry_after_is_waited_out_then_the_watch_goes_on_from_where_it_was(
    api: KubeApiServer, log: RecordedLog, start: Callable[..., PodSource]
) -> None:
    ready(api, "worker-0")
    source = start(backoff=Backoff(RetryPolicy(first=0.05, cap=5.0)))
    since = watching(api, source)
    seen = len(api.calls)
    api.fail(429, times=1, verbs=("watch",), retry_after=1)
    api.end_streams()
    refused, retried = calls_after(api, seen, 2)
    assert (refused.verb, refused.resource_version) == (retried.verb, retried.resource_version) == ("watch", since)
    assert 1.0 <= retried.at - refused.at < 1.0 + SLACK, "the Retry-After, not the back-off's 0.05 s"
    ready(api, "worker-1")
    wait_for(lambda: source.hosts() == {"worker-0": None, "worker-1": None}, 5, "worker-1 watched")
    assert api.count("list") == 1, "not listed again"
    assert events(log) == ["kubernetes_throttled", "kubernetes_recovered"]
    assert "HTTP 429" in log.said("kubernetes_throttled")[0]["reason"]


def test_a_retry_after_past_the_cap_is_capped_and_said(
    api: KubeApiServer, log: RecordedLog, start: Callable[..., PodSource]
) -> None:
    source = start(backoff=Backoff(RetryPolicy(first=0.05, cap=0.5)))
    watching(api, source)
    seen = len(api.calls)
    api.fail(429, times=1, verbs=("watch",), retry_after=120)
    api.end_streams()
    refused, retried = calls_after(api, seen, 2)
    assert 0.5 <= retried.at - refused.at < 0.5 + SLACK
    assert log.said("kubernetes_retry_after_capped") == [{"retry_after": 120.0, "waited": 0.5}]


def test_repeated_503s_are_backed_off_with_jitter_and_the_list_recovers(
    api: KubeApiServer, log: RecordedLog, start: Callable[..., PodSource]
) -> None:
    policy = RetryPolicy(first=0.05, cap=0.8)
    planned_by = Backoff(policy, random.Random(11))  # the same draws as the source's
    planned = [planned_by.wait() for _ in range(5)]
    assert planned[-1] > 4 * planned[0], "the waits grow"
    assert len({round(later / earlier, 6) for earlier, later in zip(planned, planned[1:])}) > 1, "not all x2"
    ready(api, "worker-0")
    api.fail(503, times=5, verbs=("list",))
    source = start(backoff=Backoff(policy, random.Random(11)))
    wait_for(lambda: source.hosts() == {"worker-0": None}, 10, "worker-0 listed after the 503s")
    lists = [call.at for call in api.calls if call.verb == "list"]
    assert len(lists) == 6
    for waited, wait in zip([later - earlier for earlier, later in zip(lists, lists[1:])], planned):
        assert wait <= waited < wait + SLACK, (lists, planned)
    assert events(log) == ["kubernetes_unavailable", "kubernetes_recovered"]


def test_a_watch_ended_or_failing_twice_is_watched_again_from_the_last_resource_version_and_never_listed(
    api: KubeApiServer, log: RecordedLog, start: Callable[..., PodSource]
) -> None:
    ready(api, "worker-0")
    source = start()
    watching(api, source)
    ready(api, "worker-1")
    wait_for(lambda: source.hosts() == {"worker-0": None, "worker-1": None}, 5, "worker-1 watched")
    since = source.resource_version
    seen = len(api.calls)
    api.fail(504, times=1, verbs=("watch",))
    api.fail(500, times=1, verbs=("watch",))
    api.end_streams()
    assert [(call.verb, call.resource_version) for call in calls_after(api, seen, 3)] == [("watch", since)] * 3
    api.delete_pod("worker-0")
    wait_for(lambda: source.hosts() == {"worker-1": None}, 5, "worker-0 gone")
    assert api.count("list") == 1, api.calls
    assert events(log) == ["kubernetes_unavailable", "kubernetes_recovered"]


def test_a_watch_that_fails_three_times_in_a_row_lists_again_and_says_so_once(
    api: KubeApiServer, log: RecordedLog, start: Callable[..., PodSource]
) -> None:
    ready(api, "worker-0")
    source = start()
    since = watching(api, source)
    seen = len(api.calls)
    api.fail(503, times=3, verbs=("watch",))
    api.end_streams()
    calls = calls_after(api, seen, 5)
    assert [(call.verb, call.resource_version) for call in calls[:3]] == [("watch", since)] * 3
    assert [call.verb for call in calls[3:]] == ["list", "watch"]
    ready(api, "worker-1")
    wait_for(lambda: source.hosts() == {"worker-0": None, "worker-1": None}, 5, "worker-1 watched")
    assert api.count("list") == 2
    assert [fields["reason"].split(", the last")[0] for fields in log.said("kubernetes_relist")] == [
        "the watch failed 3 times in a row"
    ]


def test_a_long_list_comes_in_pages_and_an_expired_continue_token_lists_again_from_the_start(
    api: KubeApiServer, log: RecordedLog, start: Callable[..., PodSource]
) -> None:
    names = [f"worker-{i:04}" for i in range(1201)]
    ready(api, *names)
    api.fail(410, times=1, verbs=("continue",))
    source = start()
    wait_for(lambda: len(source.hosts() or {}) == 1201, 10, "1201 pods listed")
    assert source.hosts() == dict.fromkeys(names)
    lists = [call for call in api.calls if call.verb != "watch"]
    assert [call.verb for call in lists] == ["list", "continue", "list", "continue", "continue"]
    assert {call.query["limit"] for call in lists} == {"500"}
    assert "continue token expired" in log.said("kubernetes_relist")[0]["reason"]
    ready(api, "worker-1201")
    wait_for(lambda: len(source.hosts() or {}) == 1202, 5, "a pod added after, watched")


@pytest.mark.parametrize(
    ("status", "token", "event", "reason"),
    [
        (401, True, "kubernetes_unauthorized", "the API at {url} does not accept the token in {token}"),
        (401, False, "kubernetes_unauthorized", "the API at {url} asks for a bearer token, and none is sent"),
        (403, True, "kubernetes_forbidden", f"the service account may not list pods in namespace {NAMESPACE}"),
    ],
)
def test_a_401_and_a_403_are_each_said_once_as_what_is_missing(
    api: KubeApiServer, log: RecordedLog, tmp_path: Path, status: int, token: bool, event: str, reason: str
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("not-the-cluster-s\n")
    server = ApiServer(api.url, token_file=token_file if token else None)
    source = PodSource(server, NAMESPACE, SELECTOR, log, backoff=Backoff(RetryPolicy(first=0.05, cap=0.2)))
    ready(api, "worker-0")
    api.fail(status, times=3, verbs=("list",))
    source.start()
    try:
        wait_for(lambda: source.hosts() == {"worker-0": None}, 5, "listed once accepted")
    finally:
        source.stop()
    assert api.count("list") == 4
    assert events(log) == [event, "kubernetes_recovered"], "one line, not kubernetes_unreachable"
    assert log.said(event)[0]["reason"].startswith(reason.format(url=api.url, token=token_file))


def test_connections_to_the_api_have_tcp_keepalive_and_the_read_timeout(api: KubeApiServer) -> None:
    server = ApiServer(api.url)
    connection = server.connection()
    server.connect(connection, READ_TIMEOUT)
    try:
        assert connection.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert connection.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
        assert connection.sock.gettimeout() == READ_TIMEOUT == 90.0
    finally:
        connection.close()
