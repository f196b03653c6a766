"""Nothing a peer sends crashes a service or loses its state; bad command lines get one clear line."""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import pytest
import zmq

from elastic_control_plane.bus.client import ServiceError
from elastic_control_plane.bus.envelope import MAX_MESSAGE_BYTES, Message, decode, encode
from testing.harness import REPO, SERVICES, Cluster, free_ports, wait_for


def _raw_exchange(endpoint: str, frames: list[bytes], timeout_ms: int = 2000) -> Message | None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        sock.send_multipart(frames)
        if not sock.poll(timeout_ms):
            return None
        return decode(sock.recv_multipart())
    finally:
        sock.close()


def _header(**overrides: object) -> bytes:
    header = {"v": 1, "type": "ping", "id": "x1", "round": None, "from": "tester", "reply": False, **overrides}
    return msgpack.packb(header)


BAD_INPUTS = {
    "not msgpack": ([b"\xc1\xc1garbage", b"\x00"], "malformed"),
    "one frame": ([b"just one"], "malformed"),
    "body not a map": ([_header(), msgpack.packb([1, 2])], "malformed"),
    "wrong version": ([_header(v=99), msgpack.packb({})], "version"),
    "unknown type": ([_header(type="no_such_thing"), msgpack.packb({})], "unknown_type"),
    "oversized": ([_header(), msgpack.packb({}), b"\x00" * (MAX_MESSAGE_BYTES + 1)], "too_large"),
}


@pytest.mark.parametrize("service", SERVICES)
def test_every_service_answers_bad_input_with_an_error_and_keeps_serving(cluster: Cluster, service: str) -> None:
    endpoint = getattr(cluster.endpoints, service)
    for name, (frames, code) in BAD_INPUTS.items():
        reply = _raw_exchange(endpoint, frames)
        assert reply is not None, f"{service}: no reply to {name}"
        assert reply.body.get("error") == code, f"{service}: {name} -> {reply.body}"
    for msg_type in ("submit", "register", "new_round", "enter_round", "publish", "kv_set", "drain", "worker_exited"):
        reply = _raw_exchange(
            endpoint,
            encode(Message(type=msg_type, body={"host": 7, "spec": "nonsense"}, id=f"t-{msg_type}", sender="tester")),
        )
        assert reply is not None and reply.body.get("error") in (
            "bad_request",
            "bad_spec",
            "unknown_type",
            "unknown_host",
        ), f"{service} {msg_type}: {reply}"
    assert cluster.call(service, "ping") == {"service": service}
    assert cluster.processes[service].poll() is None
    log = cluster.output(service)
    assert "bad_message" in log and "unknown_type" in log


def test_registry_keeps_its_job_through_garbage(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 1)
    job = cluster.submit("--", sys.executable, "examples/train.py", "--epochs", "200")
    wait_for(lambda: cluster.job()["state"] == "running", 60, "the job to run")
    for frames, _ in BAD_INPUTS.values():
        _raw_exchange(cluster.endpoints.registry, frames)
    _raw_exchange(
        cluster.endpoints.registry,
        encode(Message(type="worker_exited", body={"host": "host-1", "local_rank": 0, "pid": "x"}, id="w", sender="t")),
    )
    job_now = cluster.job()
    assert job_now["state"] == "running" and job_now["size"] == 1
    cluster.call("registry", "cancel", {"reason": "done"})
    cluster.wait_job_end(job, 30)


@pytest.mark.parametrize(
    "report",
    [
        "not a map",
        {"commit": -1, "bytes": 1, "written_at": 1.0},
        {"commit": 1, "bytes": True, "written_at": 1.0},
        {"commit": 1, "bytes": 1, "written_at": "now"},
        {"commit": 1, "bytes": 1, "written_at": 1.0, "path": "x" * 5000},
    ],
)
def test_discovery_refuses_a_malformed_snapshot_report_and_keeps_the_last_good_one(
    cluster: Cluster, report: object
) -> None:
    cluster.call("discovery", "register", {"host": "h1", "slots": 1, "incarnation": "i1"})
    good = {"commit": 3, "bytes": 10, "written_at": 1.0}
    cluster.call("discovery", "heartbeat", {"host": "h1", "incarnation": "i1", "snapshot": good})
    with pytest.raises(ServiceError) as refused:
        cluster.call("discovery", "heartbeat", {"host": "h1", "incarnation": "i1", "snapshot": report})
    assert refused.value.code == "bad_request" and "snapshot" in refused.value.message
    host = next(h for h in cluster.call("discovery", "hosts")["all"] if h["host"] == "h1")
    assert host["snapshot"] == good


def _elasticctl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def _assert_one_clear_line(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("elasticctl: ") and "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_errors_are_one_line_without_traceback() -> None:
    ports = free_ports(5)
    env = {
        **os.environ,
        **{
            f"ELASTIC_{n}_ENDPOINT": f"tcp://127.0.0.1:{p}"
            for n, p in zip(("DISCOVERY", "RENDEZVOUS", "REGISTRY", "NOTIFIER", "EVENTS"), ports)
        },
    }
    _assert_one_clear_line(_elasticctl("status", env=env), "cannot reach", f"127.0.0.1:{ports[2]}")
    _assert_one_clear_line(_elasticctl("drain", "host-9", env=env), "cannot reach")
    _assert_one_clear_line(
        _elasticctl("run", "--min-np", "4", "--max-np", "2", "--", "true", env=env),
        "--min-np (4) must not exceed --max-np (2)",
    )
    _assert_one_clear_line(_elasticctl("run", env=env), "Missing argument")
    _assert_one_clear_line(_elasticctl("run", "--min-np", "zero", "--", "true", env=env), "min-np")
    _assert_one_clear_line(_elasticctl("local", "--hosts", "0", "--", "true", env=env), "hosts")
    _assert_one_clear_line(
        _elasticctl("local", "--slots", "1", "--standby", "2", "--", "true", env=env),
        "--standby 2 is more than this host's 1 slot(s)",
    )
    _assert_one_clear_line(
        _elasticctl("run", "--max-restarts", "-1", "--", "true", env=env), "--max-restarts must be at least 0"
    )
    _assert_one_clear_line(
        _elasticctl("run", "--restart-window", "0", "--", "true", env=env), "--restart-window must be a positive number"
    )
    _assert_one_clear_line(
        _elasticctl("run", "--checkpoint-interval", "0", "--", "true", env=env),
        "--checkpoint-interval must be a positive number",
    )
    _assert_one_clear_line(
        _elasticctl("local", "--checkpoint-interval", "-1", "--", "true", env=env),
        "--checkpoint-interval must be a positive number",
    )
    _assert_one_clear_line(_elasticctl("run", "--checkpoint-dir", "/etc/hostname", "--", "true", env=env), "is a file")
    _assert_one_clear_line(_elasticctl("nonsense", env=env), "No such command")


def test_unknown_host_is_a_clear_error(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 1)
    result = cluster.elasticctl("drain", "host-9")
    _assert_one_clear_line(result, "unknown host 'host-9'", "host-1")
    assert cluster.elasticctl("drain", "host-1").returncode == 0
    assert cluster.status()["hosts"][0]["state"] in ("draining", "drained")


def test_a_second_local_control_plane_is_refused_clearly(cluster: Cluster) -> None:
    result = cluster.elasticctl("local", "--hosts", "1", "--", sys.executable, "examples/train.py")
    _assert_one_clear_line(result, "already answers at", cluster.endpoints.registry)


@pytest.mark.parametrize(
    ("service", "msg_type", "body"),
    [
        ("discovery", "restore", {"marks": "all", "expected": []}),
        ("discovery", "restore", {"marks": {"h": {"draining": "yes"}}, "expected": []}),
        ("discovery", "restore", {"marks": {}, "expected": [["h", [-1]]]}),
        ("rendezvous", "restore_round", {"round": 3, "hosts": "none", "pids": []}),
        ("rendezvous", "restore_round", {"round": 3, "hosts": [["h"]], "pids": []}),
        ("rendezvous", "restore_round", {"round": 3, "hosts": [["h", []]], "pids": []}),
        ("rendezvous", "restore_round", {"round": 3, "hosts": [["h", [0]]], "pids": "none"}),
    ],
)
def test_a_malformed_restore_is_refused_and_changes_nothing(
    cluster: Cluster, service: str, msg_type: str, body: dict[str, object]
) -> None:
    def held() -> object:
        reply = cluster.call(service, "hosts" if service == "discovery" else "status")
        return (reply["all"], reply["available"]) if service == "discovery" else reply

    before = held()
    with pytest.raises(ServiceError) as refused:
        cluster.call(service, msg_type, body)
    assert refused.value.code == "bad_request"
    assert held() == before


def test_an_agent_given_timing_that_breaks_a_rule_says_so_in_one_line_and_exits_2(tmp_path) -> None:
    env = {**os.environ, "ELASTIC_HEARTBEAT": "5", "ELASTIC_COLLECTIVE_TIMEOUT": "10", "ELASTIC_RUN_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.agent.main", "--host", "h1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("elastic-agent: ELASTIC_COLLECTIVE_TIMEOUT='10.0': must exceed")
    ), result.stderr


def test_an_agent_without_keys_refuses_a_control_plane_off_loopback_in_one_line(tmp_path) -> None:
    """Plaintext to another machine authenticates nobody: whoever answers there would serve the job (issue 58). The
    innocent twin, an agent without keys on loopback, is every other test of the suite."""
    env = {**os.environ, "ELASTIC_RUN_DIR": str(tmp_path)}
    env.pop("ELASTIC_KEYS", None)
    env.pop("ELASTIC_INSECURE", None)
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.agent.main", "--host", "h1", "--control", "192.0.2.7"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("elastic-agent: refusing to connect to tcp://192.0.2.7:5550 without CURVE keys"), last
