"""The health gate and uncordon, with real processes: a host whose `--health-check` fails never enters a round
while the job trains on the others, and enters once it passes; a passing check costs no wait worth noting; a check
that hangs is killed at its timeout with what it started; `elasticctl uncordon` lets a blacklisted host back; bad
settings and bad reports are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from elastic_control_plane.bus.client import ServiceError
from elastic_control_plane.elasticctl.local_processes import agent_argv
from testing.harness import REPO, Cluster, wait_for, worker_pid
from tests.integration.training import JOB, start_training, steps, wait_for_size

# A 0.5 s heartbeat (lost after 5 s of silence): a machine shared with other suites stalls an agent, and a host lost
# is not what these tests test.
pytestmark = pytest.mark.cluster_env({"ELASTIC_HEARTBEAT": "0.5"})


def row(cluster: Cluster, name: str) -> dict:
    return next(h for h in cluster.call("discovery", "hosts")["all"] if h["host"] == name)


def available(cluster: Cluster) -> list[str]:
    return [name for name, _ in cluster.call("discovery", "hosts")["available"]]


def test_a_host_failing_its_check_never_enters_a_round_and_enters_once_it_passes(
    cluster: Cluster, tmp_path: Path
) -> None:
    ok_file = tmp_path / "ok"
    cluster.start_agent("host-1", 2)
    cluster.start_agent("host-2", 2)
    cluster.start_agent(
        "host-3",
        2,
        ["--health-check", f"echo waiting for {ok_file}; test -e {ok_file}", "--health-check-interval", "0.5"],
    )
    wait_for(lambda: row(cluster, "host-3")["state"] == "unhealthy", 20, "host-3 held by its failing check")
    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--min-np", "2", "--", *JOB, "--epochs", "10", "--step-delay", "0.1", "--log-dir", str(log_dir)
    )
    wait_for_size(log_dir, 4)
    host3 = row(cluster, "host-3")
    assert host3["health_hold"] == f"health check failed: exit code 1: waiting for {ok_file}"
    table = cluster.elasticctl("status").stdout
    assert f"health check failed: exit code 1: waiting for {ok_file} (next check in" in table, table
    assert "host-3" not in available(cluster)
    ok_file.touch()
    admitted_after = time.time()
    wait_for_size(log_dir, 6, after=admitted_after)
    assert cluster.wait_job_end(job, 300) == 0, cluster.output("elasticctl-run")
    before = [e for e in steps(log_dir) if e["time"] < admitted_after]
    assert before and all(e["size"] <= 4 for e in before), "a step at world size 6 before host-3's check passed"
    assert "health_checked" in cluster.output("agent-host-3")


def test_a_passing_check_admits_the_host_at_once(cluster: Cluster) -> None:
    started = time.monotonic()
    cluster.start_agent("host-1", 1, ["--health-check", "true"])
    wait_for(lambda: "host-1" in available(cluster), 20, "host-1 available")
    took = time.monotonic() - started
    health = row(cluster, "host-1")["health"]
    assert health["ok"] and health["reason"] == "" and row(cluster, "host-1")["state"] == "active"
    # An agent without a command of its own gets there the same way: the check adds no heartbeat's worth of wait.
    started = time.monotonic()
    cluster.start_agent("host-2", 1)
    wait_for(lambda: "host-2" in available(cluster), 20, "host-2 available")
    assert took < 2 * (time.monotonic() - started) + 1.0, f"a passing check held host-1 back {took:.2f}s"


def test_a_hanging_check_is_killed_at_its_timeout_and_counts_as_failed(cluster: Cluster) -> None:
    seconds = 3000 + uuid.uuid4().int % 1000  # names this test's sleeps among the machine's processes
    cluster.start_agent(
        "host-1",
        1,
        [
            "--health-check",
            f"sleep {seconds} & sleep {seconds}",
            "--health-check-timeout",
            "1",
            "--health-check-interval",
            "600",
        ],
    )
    wait_for(
        lambda: row(cluster, "host-1")["health_hold"] == "health check failed: timed out after 1s",
        20,
        "the hung check judged failed",
    )
    assert row(cluster, "host-1")["state"] == "unhealthy"

    def sleeps() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "cmdline").read_bytes() == f"sleep\0{seconds}\0".encode():
                    if (entry / "stat").read_text().split()[2] != "Z":
                        found.append(int(entry.name))
            except OSError:
                continue
        return found

    wait_for(lambda: not sleeps(), 10, "no process of the check left")


def test_uncordon_lets_a_blacklisted_host_back(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_training(
        cluster, tmp_path, "--blacklist-cooldown", "600", "600", "--max-restarts", "0", epochs=10, step_delay=0.1
    )
    os.kill(worker_pid(cluster, "host-2", 1), signal.SIGKILL)
    wait_for(lambda: row(cluster, "host-2")["state"] == "blacklisted", 30, "host-2 blacklisted")
    wait_for_size(log_dir, 2)
    assert row(cluster, "host-2")["blacklist_count"] == 1
    uncordoned = cluster.elasticctl("uncordon", "host-2")
    assert uncordoned.returncode == 0, uncordoned.stderr
    assert uncordoned.stdout.startswith("host-2: uncordoned (")
    back = time.time()
    wait_for_size(log_dir, 4, after=back)
    host2 = row(cluster, "host-2")
    assert host2["blacklist_count"] == 0 and not host2["blacklisted"] and host2["health"]["request"] >= 1
    assert cluster.wait_job_end(job, 300) == 0, cluster.output("elasticctl-run")


def test_a_host_out_of_its_cooldown_enters_only_after_a_fresh_check_passes(cluster: Cluster, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    cluster.start_agent("host-1", 2)
    cluster.start_agent(
        "host-2",
        2,
        ["--health-check", f"test ! -e {broken} || (echo {broken}; exit 1)", "--health-check-interval", "0.5"],
    )
    log_dir = tmp_path / "train"
    job = cluster.submit(
        *("--min-np", "2", "--blacklist-cooldown", "3", "3", "--max-restarts", "0", "--"),
        *(*JOB, "--epochs", "10", "--step-delay", "0.1", "--log-dir", str(log_dir)),
    )
    wait_for_size(log_dir, 4)
    broken.touch()  # its last check passed; the one after its cooldown will not
    os.kill(worker_pid(cluster, "host-2", 1), signal.SIGKILL)
    wait_for(lambda: row(cluster, "host-2")["state"] == "blacklisted", 30, "host-2 blacklisted")
    held = f"health check failed: exit code 1: {broken}"
    wait_for(lambda: row(cluster, "host-2")["health_hold"] == held, 30, "host-2 rechecked after its cooldown")
    host2 = row(cluster, "host-2")
    assert host2["state"] == "unhealthy" and host2["health"]["request"] >= 1
    assert host2["blacklist_count"] == 1 and host2["blacklist_reason"]
    held_from = time.time()
    wait_for_size(log_dir, 2, after=held_from)
    broken.unlink()
    healthy_from = time.time()
    wait_for_size(log_dir, 4, after=healthy_from)
    assert not [e for e in steps(log_dir) if held_from < e["time"] < healthy_from and e["size"] == 4]
    assert cluster.wait_job_end(job, 300) == 0, cluster.output("elasticctl-run")


def test_bad_check_settings_get_one_line_and_exit_2(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "ELASTIC_RUN_DIR": str(tmp_path)}
    for args, message in [
        (["--health-check-timeout", "0"], "elastic-agent: --health-check-timeout must be more than 0 seconds (got 0)"),
        (
            ["--health-check-interval", "-1"],
            "elastic-agent: --health-check-interval must be more than 0 seconds (got -1)",
        ),
        (["--health-min-shm", "-5"], "elastic-agent: --health-min-shm must be 0 MiB or more (got -5)"),
        (["--health-check", " "], "elastic-agent: --health-check must be a command (got an empty one)"),
    ]:
        result = subprocess.run(
            agent_argv("host-1", 1, *args), env=env, cwd=REPO, capture_output=True, text=True, timeout=60
        )
        assert (result.returncode, result.stderr.strip().splitlines()[-1]) == (2, message), result.stderr
    result = subprocess.run(
        agent_argv("host-1", 1, "--health-check-timeout", "soon"),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        result.returncode == 2
        and "Invalid value for '--health-check-timeout': 'soon' is not a valid float" in result.stderr
    )


def test_a_malformed_health_report_is_refused_and_discovery_keeps_serving(cluster: Cluster) -> None:
    body = {"host": "host-9", "slots": 1, "incarnation": "x", "health": {"ok": "yes"}}
    with pytest.raises(ServiceError) as refused:
        cluster.call("discovery", "register", body)
    assert refused.value.code == "bad_request" and "health" in str(refused.value)
    assert "host-9" not in [h["host"] for h in cluster.call("discovery", "hosts")["all"]]
    assert cluster.call("discovery", "ping") is not None
