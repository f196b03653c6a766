"""Endpoints built from flags and the environment are checked once, in bus/config: scheme, host, port; endpoint
lists (several control hosts) element by element; and what a service replica binds of them (services/cli.py)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.bus.config import (
    TIMING_PRESETS,
    ConfigError,
    Endpoints,
    Timing,
    check_endpoint,
    check_host,
    control_address,
    control_hosts,
    endpoint_list,
    is_loopback,
    tcp_endpoint,
    unresolved_hosts,
)
from elastic_control_plane.bus.sockets import Security, SecurityError
from elastic_control_plane.replication.election import ElectionTiming
from elastic_control_plane.services.cli import BIND_NEEDED, bind_endpoints

ENDPOINT_VARS = [f"ELASTIC_{name}_ENDPOINT" for name in ("DISCOVERY", "RENDEZVOUS", "REGISTRY", "NOTIFIER", "EVENTS")]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ELASTIC_CONTROL", *ENDPOINT_VARS):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5550",
        "tcp://discovery:1",
        "tcp://node-7.example.org:65535",
        "tcp://[::1]:5550",
        "ipc:///tmp/agent.sock",
    ],
)
def test_good_endpoints_pass(endpoint: str) -> None:
    assert check_endpoint("ELASTIC_REGISTRY_ENDPOINT", endpoint) == endpoint


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("not-an-endpoint", "not an endpoint (want tcp://HOST:PORT or ipc://PATH)"),
        ("udp://127.0.0.1:5552", "scheme 'udp' is not supported (want tcp://HOST:PORT or ipc://PATH)"),
        ("tcp://127.0.0.1", "no port (want tcp://HOST:PORT)"),
        ("tcp://127.0.0.1:http", "no port (want tcp://HOST:PORT)"),
        ("tcp://127.0.0.1:70000", "port 70000 is out of range (1-65535)"),
        ("tcp://127.0.0.1:0", "port 0 is out of range (1-65535)"),
        ("tcp://:5552", "no host (want tcp://HOST:PORT)"),
        ("tcp://bad host:5552", "'bad host' is not a host name or an IP address"),
        ("tcp://*:5552", "'*' is not a host name or an IP address"),
        ("tcp://300.1.1.1:5552", "'300.1.1.1' is not an IP address"),
        ("ipc://", "no path (want ipc://PATH)"),
    ],
)
def test_bad_endpoints_name_the_setting_and_the_value(endpoint: str, problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        check_endpoint("ELASTIC_REGISTRY_ENDPOINT", endpoint)
    assert str(raised.value) == f"ELASTIC_REGISTRY_ENDPOINT={endpoint!r}: {problem}"
    assert isinstance(raised.value, ValueError)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "control-plane.internal", "::1", "[::1]", "registry_1"])
def test_good_hosts_pass(host: str) -> None:
    assert check_host("--control", host) == host


@pytest.mark.parametrize("host", ["", "tcp://127.0.0.1:5550", "a b", "-dash", "host/1", "1.2.3.256"])
def test_bad_hosts_are_refused(host: str) -> None:
    with pytest.raises(ConfigError, match=r"^--control="):
        check_host("--control", host)


def test_from_env_checks_every_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_REGISTRY_ENDPOINT", "not-an-endpoint")
    with pytest.raises(ConfigError, match=r"^ELASTIC_REGISTRY_ENDPOINT='not-an-endpoint': not an endpoint"):
        Endpoints.from_env()


def test_from_env_names_where_the_control_host_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"^--control='a b': "):
        Endpoints.from_env("a b")
    with pytest.raises(ConfigError, match=r"^ELASTIC_CONTROL='a b': "):
        Endpoints.from_env("a b", "ELASTIC_CONTROL")
    monkeypatch.setenv("ELASTIC_CONTROL", "x:y:z")
    with pytest.raises(ConfigError, match=r"^ELASTIC_CONTROL='x:y:z': 'x:y:z' is not a host name or an IP address"):
        Endpoints.from_env()


def test_from_env_defaults_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Endpoints.from_env() == Endpoints.on_host("127.0.0.1")
    monkeypatch.setenv("ELASTIC_CONTROL", "control.example")
    monkeypatch.setenv("ELASTIC_EVENTS_ENDPOINT", "tcp://10.0.0.9:6000")
    endpoints = Endpoints.from_env()
    assert endpoints.discovery == "tcp://control.example:5550"
    assert endpoints.events == "tcp://10.0.0.9:6000"
    assert Endpoints.from_env("::1").registry == "tcp://[::1]:5552"
    assert endpoints.values() == [
        endpoints.discovery,
        endpoints.rendezvous,
        endpoints.registry,
        endpoints.notifier,
        endpoints.events,
    ]


def test_tcp_endpoint_brackets_ipv6() -> None:
    assert tcp_endpoint("::", 5550) == "tcp://[::]:5550"
    assert tcp_endpoint("0.0.0.0", "5550") == "tcp://0.0.0.0:5550"


def test_timing_names_a_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_HEARTBEAT", "soon")
    with pytest.raises(ConfigError, match=r"^ELASTIC_HEARTBEAT='soon': not a number$"):
        Timing.from_env()


@pytest.mark.parametrize(
    "env, message",
    [
        ({"ELASTIC_HEARTBEAT": "0"}, "ELASTIC_HEARTBEAT='0.0': must be a positive number of seconds"),
        ({"ELASTIC_LEASE_TTL": "0"}, "ELASTIC_LEASE_TTL='0': must be a whole number, at least 1"),
        ({"ELASTIC_DRIVER_TICK": "2"}, "ELASTIC_DRIVER_TICK='2.0': must not exceed ELASTIC_HEARTBEAT (1 s)"),
        (
            {"ELASTIC_HEARTBEAT": "5", "ELASTIC_COLLECTIVE_TIMEOUT": "15"},
            "ELASTIC_COLLECTIVE_TIMEOUT='15.0': must exceed ELASTIC_HEARTBEAT x ELASTIC_MISSED_HEARTBEATS (15 s)",
        ),
    ],
)
def test_timing_rules_are_checked_together_at_start(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        Timing.from_env()
    assert str(info.value).startswith(message)


def test_unresolved_hosts_are_named_once() -> None:
    endpoints = [
        "tcp://not-a-host.invalid:5550",
        "tcp://not-a-host.invalid:5551",
        "tcp://127.0.0.1:5552",
        "tcp://[::1]:5553",
        "ipc:///tmp/x.sock",
    ]
    assert unresolved_hosts(endpoints) == ["not-a-host.invalid"]


THREE_HOSTS = "127.0.0.1,127.0.0.2,127.0.0.3"


def test_several_control_hosts_give_every_service_an_endpoint_list_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    endpoints = Endpoints.from_env(THREE_HOSTS)
    assert endpoints.rendezvous == "tcp://127.0.0.1:5551,tcp://127.0.0.2:5551,tcp://127.0.0.3:5551"
    assert endpoint_list(endpoints.events) == ["tcp://127.0.0.1:5554", "tcp://127.0.0.2:5554", "tcp://127.0.0.3:5554"]
    assert Endpoints.from_env("::1,control-b").registry == "tcp://[::1]:5552,tcp://control-b:5552"
    assert Endpoints.on_hosts(["127.0.0.1"]) == Endpoints.on_host("127.0.0.1") == Endpoints.from_env()
    monkeypatch.setenv("ELASTIC_CONTROL", "a,b")
    assert Endpoints.from_env().discovery == "tcp://a:5550,tcp://b:5550"


def test_an_endpoint_setting_may_be_an_endpoint_list(monkeypatch: pytest.MonkeyPatch) -> None:
    replicas = "tcp://10.0.0.1:6000,tcp://10.0.0.2:6000,ipc:///tmp/registry.sock"
    monkeypatch.setenv("ELASTIC_CONTROL", "a,b")
    monkeypatch.setenv("ELASTIC_REGISTRY_ENDPOINT", replicas)
    endpoints = Endpoints.from_env()
    assert endpoints.registry == replicas
    assert endpoints.notifier == "tcp://a:5553,tcp://b:5553"
    assert endpoint_list("tcp://a:1") == ["tcp://a:1"]


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (
            "tcp://a:5552,tcp://bad host:5552",
            "in 'tcp://bad host:5552': 'bad host' is not a host name or an IP address",
        ),
        ("tcp://a:5552,tcp://b", "in 'tcp://b': no port (want tcp://HOST:PORT)"),
        ("tcp://a:5552,", "in '': not an endpoint (want tcp://HOST:PORT or ipc://PATH)"),
        ("tcp://a:5552,tcp://b:5552,tcp://a:5552", "'tcp://a:5552' is named twice"),
    ],
)
def test_a_bad_endpoint_of_a_list_is_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, value: str, problem: str
) -> None:
    monkeypatch.setenv("ELASTIC_REGISTRY_ENDPOINT", value)
    with pytest.raises(ConfigError) as raised:
        Endpoints.from_env()
    assert str(raised.value) == f"ELASTIC_REGISTRY_ENDPOINT={value!r}: {problem}"


@pytest.mark.parametrize(
    ("control", "problem"),
    [
        ("a,b,a", "'a' is named twice"),
        ("a,b c", "'b c' is not a host name or an IP address"),
        ("a,,b", "an empty host"),
        ("a,tcp://b:5550", "'tcp://b:5550' is not a host name or an IP address"),
        ("a,a:5550", "'a:5550' is named twice"),
        ("a:http", "port 'http' of 'a:http' is not a number from 1 to 65531 (the first of five)"),
        ("a:65533", "port '65533' of 'a:65533' is not a number from 1 to 65531 (the first of five)"),
        (":6550", "an empty host"),
    ],
)
def test_a_bad_or_twice_named_control_host_is_refused(control: str, problem: str) -> None:
    with pytest.raises(ConfigError) as raised:
        Endpoints.from_env(control)
    assert str(raised.value) == f"--control={control!r}: {problem}"


def test_a_control_host_with_a_port_puts_the_services_on_it_and_the_four_after() -> None:
    endpoints = Endpoints.from_env("node1:6550,[::1]:6560,10.0.0.3,::2")
    assert endpoints.discovery == "tcp://node1:6550,tcp://[::1]:6560,tcp://10.0.0.3:5550,tcp://[::2]:5550"
    assert endpoints.events == "tcp://node1:6554,tcp://[::1]:6564,tcp://10.0.0.3:5554,tcp://[::2]:5554"
    assert control_hosts("--control", "node1:6550,[::1]:6560,::2") == ["node1", "[::1]", "::2"]
    assert [control_address("node1", 5550), control_address("node1", 6550), control_address("::1", 6560)] == [
        "node1",
        "node1:6550",
        "[::1]:6560",
    ]


def test_unresolved_hosts_of_endpoint_lists() -> None:
    lists = ["tcp://127.0.0.1:5550,tcp://not-a-host.invalid:5550", "tcp://not-a-host.invalid:5551,ipc:///tmp/x.sock"]
    assert unresolved_hosts(lists) == ["not-a-host.invalid"]


def test_a_replica_binds_its_own_host_of_the_list() -> None:
    connect = Endpoints.from_env(THREE_HOSTS)
    bind = bind_endpoints(connect, "127.0.0.2", "--bind", "notifier")
    assert bind == Endpoints.on_host("127.0.0.2")
    moved = Endpoints(**{**vars(connect), "registry": "tcp://127.0.0.1:6000,tcp://127.0.0.2:6001"})
    assert bind_endpoints(moved, "127.0.0.2", "--bind", "registry").registry == "tcp://127.0.0.2:6001"
    assert bind_endpoints(moved, "0.0.0.0", "--bind", "registry").registry == "tcp://0.0.0.0:6000", "the first's port"


def test_a_replica_of_a_service_on_several_hosts_needs_bind() -> None:
    connect = Endpoints.from_env(THREE_HOSTS)
    for service in ("discovery", "rendezvous", "registry", "notifier"):
        with pytest.raises(ConfigError, match=f": {BIND_NEEDED}$") as raised:
            bind_endpoints(connect, None, "--bind", service)
        assert raised.value.setting == f"ELASTIC_{service.upper()}_ENDPOINT"
        assert "\n" not in str(raised.value)
    single = Endpoints.on_host("127.0.0.1")
    assert bind_endpoints(single, None, "--bind", "registry") is single
    events_replicated = Endpoints(**{**vars(single), "events": connect.events})
    assert bind_endpoints(events_replicated, None, "--bind", "registry") is events_replicated
    with pytest.raises(ConfigError, match=r"^ELASTIC_EVENTS_ENDPOINT="):
        bind_endpoints(events_replicated, None, "--bind", "notifier")


@pytest.mark.parametrize("host", ["localhost", "127.0.0.3", "[::1]"])
def test_loopback_hosts_bind_without_keys(host: str) -> None:
    assert is_loopback(host)
    Security().check_bind(tcp_endpoint(host, 5550))


@pytest.mark.parametrize("host", ["10.0.0.1", "control-a", "0.0.0.0"])
def test_other_hosts_are_no_loopback_and_need_keys_to_bind(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(SecurityError):
        Security().check_bind(tcp_endpoint(host, 5550))


def test_the_agents_intervals_keep_their_rules_with_every_timing_the_tests_and_defaults_use() -> None:
    INTERVALS.check(Timing())
    INTERVALS.check(Timing(heartbeat=0.2, missed_heartbeats=3, discovery_poll=0.2, driver_tick=0.05))


@pytest.mark.parametrize(
    "intervals, timing, rule",
    [
        ({}, {"heartbeat": 0.04, "driver_tick": 0.01}, "the agent's tick (0.05 s) within a heartbeat"),
        ({"sample_after": 40.0}, {}, "sample_after < the hang floor (30 s)"),
        ({"dump_grace": 6.0}, {}, "a stack dump's grace within a stop's"),
        ({"restart_backoff_first": 60.0}, {}, "0 < restart back-off <= its cap"),
    ],
)
def test_the_agents_intervals_that_break_a_rule_are_refused_in_one_line(
    intervals: dict[str, float], timing: dict[str, float], rule: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(rule)):
        replace(INTERVALS, **intervals).check(Timing(**timing))


def test_the_cloud_preset_sets_every_interval_and_each_variable_still_overrides_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ELASTIC_TIMING", "cloud")
    cloud = Timing.from_env()
    assert cloud == TIMING_PRESETS["cloud"]
    assert (cloud.lost_after, cloud.lease_ttl, cloud.request_timeout) == (10.0, 5, 4.0)
    INTERVALS.check(cloud)  # the agent's own intervals keep their rules with it
    ElectionTiming(cloud.lease_ttl)  # and so does the election
    monkeypatch.setenv("ELASTIC_LEASE_TTL", "3")
    assert Timing.from_env() == replace(TIMING_PRESETS["cloud"], lease_ttl=3)
    monkeypatch.delenv("ELASTIC_TIMING")
    assert Timing.from_env() == Timing(lease_ttl=3), "local, today's intervals, by default"


def test_an_unknown_timing_preset_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTIC_TIMING", "fast")
    with pytest.raises(ConfigError, match=r"^ELASTIC_TIMING='fast': not a preset \(one of: local, cloud\)$"):
        Timing.from_env()
