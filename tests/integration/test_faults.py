"""Faults injected while training, with real processes (issue 4's done-when list)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from testing.harness import HOST_LOST_AFTER, Cluster, read_events, wait_for, worker_pid
from tests.integration.training import JOB, assert_training_invariants, host_row, start_training, steps, wait_for_size


def test_kill_9_of_a_worker_with_horovods_rule_resumes_from_the_last_commit_and_blacklists_its_host(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, log_dir = start_training(cluster, tmp_path, "--blacklist-cooldown", "600", "600", "--max-restarts", "0")
    os.kill(worker_pid(cluster, "host-2", 1), signal.SIGKILL)
    wait_for_size(log_dir, 2)
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    host2 = host_row(cluster, "host-2")
    assert host2["state"] == "blacklisted" and host2["blacklist_reason"].startswith(
        "round 1: rank 3 on host-2 exited with code -9; crashed; --max-restarts 0"
    )
    assert "blacklisted" in cluster.elasticctl("status").stdout


def test_kill_9_of_an_agent_is_a_losthost_row(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_training(cluster, tmp_path)
    cluster.processes["agent-host-2"].send_signal(signal.SIGKILL)
    wait_for(
        lambda: host_row(cluster, "host-2")["state"] == "lost",
        0.2 * 3 + 2.0,
        "host-2 declared lost within 3 heartbeats (+ slack)",
    )
    wait_for_size(log_dir, 2)
    view = cluster.status()
    assert any(w["reason"] for w in view["workers"]) or view["job"]["round"] >= 2
    assert cluster.wait_job_end(job, 180) == 0
    assert_training_invariants(log_dir)
    lost = host_row(cluster, "host-2")
    assert (
        lost["state"] == "lost" and lost["blacklisted"] and "host lost (missed heartbeats)" in lost["blacklist_reason"]
    )
    table = cluster.elasticctl("status").stdout
    assert "no heartbeat for" in table and "host lost (missed heartbeats)" in table


def test_sigstop_of_an_agent_is_a_hunghost_row(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_training(cluster, tmp_path)
    cluster.processes["agent-host-2"].send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: host_row(cluster, "host-2")["state"] == "lost", HOST_LOST_AFTER + 2.0, "host-2 declared lost")
        wait_for_size(log_dir, 2, timeout=30)
        assert cluster.wait_job_end(job, 180) == 0
        assert_training_invariants(log_dir)
        lost = host_row(cluster, "host-2")
        assert lost["state"] == "lost" and lost["blacklisted"]
    finally:
        cluster.processes["agent-host-2"].send_signal(signal.SIGCONT)


def test_a_worker_hung_in_a_collective_is_cut_loose(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, {"ELASTIC_COLLECTIVE_TIMEOUT": "3"})
    try:
        cluster.start_services()
        cluster.start_agent("host-1", 2)
        cluster.start_agent("host-2", 2)
        log_dir = tmp_path / "train"
        job = cluster.submit(
            "--min-np",
            "2",
            "--hung-timeout",
            "2",
            "--",
            *JOB,
            "--epochs",
            "3",
            "--step-delay",
            "0.02",
            "--log-dir",
            str(log_dir),
        )
        wait_for_size(log_dir, 4)
        stopped = worker_pid(cluster, "host-2", 0)
        os.kill(stopped, signal.SIGSTOP)
        stopped_at = max(e["time"] for e in steps(log_dir))
        stopped_round = max(e["round"] for e in steps(log_dir))
        # Stopped outside a collective, it is found by the others' waits and its slot restarts in place; stopped
        # inside one, the others time out and its slot fails: either way the others train on in a later round.
        resumed_at = wait_for(
            lambda: min((e["time"] for e in steps(log_dir) if e["round"] > stopped_round), default=None),
            30,
            "the survivors training in a later round",
        )
        assert resumed_at - stopped_at < 3 + 2 + 5, (
            "survivors released within collective timeout + hung timeout (+ slack)"
        )
        assert cluster.wait_job_end(job, 180) == 0
        assert_training_invariants(log_dir)
        wait_for(
            lambda: (
                not Path(f"/proc/{stopped}").exists() or Path(f"/proc/{stopped}/stat").read_text().split()[2] == "Z"
            ),
            10,
            "the hung worker to be killed",
        )
    finally:
        cluster.close()


def test_a_frozen_host_that_serves_rank_0_never_holds_up_the_survivors(tmp_path: Path) -> None:
    """A host freezes (its agent and workers stop, as a kernel hang leaves them: nothing kills the workers) while
    it holds rank 0, whose process serves the round's store. The survivors, waiting in a step, must not wait on
    that store: the control plane's abort reaches them and they train on at size 2. (A collective timeout of 6 s, past
    the 2 s after which the host counts as lost: the abort, not the timeout, cuts them loose.)"""
    cluster = Cluster(tmp_path, {"ELASTIC_COLLECTIVE_TIMEOUT": "6"})
    frozen: list[int] = []
    try:
        cluster.start_services()
        cluster.start_agent("host-1", 2)
        cluster.start_agent("host-2", 2)
        log_dir = tmp_path / "train"
        job = cluster.submit(
            "--min-np", "2", "--", *JOB, "--epochs", "3", "--step-delay", "0.02", "--log-dir", str(log_dir)
        )
        wait_for_size(log_dir, 4)
        host_of_rank_0 = wait_for(
            lambda: next((e["host"] for e in steps(log_dir) if e["rank"] == 0), None), 30, "a step of rank 0 logged"
        )
        frozen = [cluster.processes[f"agent-{host_of_rank_0}"].pid] + [
            worker_pid(cluster, host_of_rank_0, local_rank) for local_rank in (0, 1)
        ]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        stopped_at = max(e["time"] for e in steps(log_dir))
        wait_for_size(log_dir, 2, after=stopped_at, timeout=30)
        assert cluster.wait_job_end(job, 180) == 0
        assert_training_invariants(log_dir)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        cluster.close()


def test_reset_limit_stops_the_job_with_a_message(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 2)
    cluster.start_agent("host-2", 2)
    job = cluster.submit(
        "--min-np",
        "2",
        "--reset-limit",
        "2",
        "--blacklist-cooldown",
        "0",
        "0",
        "--",
        sys.executable,
        "tests/workers/flaky.py",
    )
    code = cluster.wait_job_end(job, 120)
    output = cluster.output("elasticctl-run")
    assert code != 0
    assert "reset limit 2 reached" in output, output


def test_a_script_failing_everywhere_stops_with_all_hosts_failed(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 2)
    cluster.start_agent("host-2", 1)
    job = cluster.submit("--", sys.executable, "-c", "import libworker as e; e.init(); raise SystemExit(4)")
    assert cluster.wait_job_end(job, 60) == 4
    assert "all hosts failed" in cluster.output("elasticctl-run")


def test_a_blacklisted_host_returns_after_its_cooldown(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_training(
        cluster, tmp_path, "--blacklist-cooldown", "2", "2", "--max-restarts", "0", epochs=4, step_delay=0.03
    )
    os.kill(worker_pid(cluster, "host-2", 0), signal.SIGKILL)
    wait_for_size(log_dir, 2)
    shrunk_at = min(e["time"] for e in steps(log_dir) if e["size"] == 2)
    wait_for_size(log_dir, 4, after=shrunk_at, timeout=60)
    assert cluster.wait_job_end(job, 180) == 0
    assert_training_invariants(log_dir)
    assert any(e["host"] == "host-2" and e["time"] > shrunk_at for e in read_events(log_dir))


def test_workers_keep_training_while_the_control_plane_is_unreachable(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_training(cluster, tmp_path)
    paused = [cluster.processes[name] for name in ("discovery", "registry", "rendezvous", "notifier")]
    for process in paused:
        process.send_signal(signal.SIGSTOP)
    try:
        stopped_at = max(e["time"] for e in steps(log_dir))
        wait_for(
            lambda: (
                (times := [e["time"] for e in steps(log_dir) if e["time"] > stopped_at])
                and len(times) >= 40
                and max(times) - stopped_at > 0.2 * 3
            ),
            30,
            "steps for longer than the heartbeat deadline while the control plane is stopped",
        )
        time_without = max(e["time"] for e in steps(log_dir)) - stopped_at
        assert time_without > 0.2 * 3, "longer than the heartbeat deadline"
    finally:
        for process in paused:
            process.send_signal(signal.SIGCONT)
    assert cluster.wait_job_end(job, 180) == 0
    assert {e["round"] for e in read_events(log_dir)} == {1}, "no host was declared lost"


def test_when_every_host_is_blacklisted_the_job_stops(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2)
    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--max-restarts", "0", "--", *JOB, "--epochs", "50", "--step-delay", "0.02", "--log-dir", str(log_dir)
    )
    wait_for_size(log_dir, 2)
    os.kill(worker_pid(cluster, "host-1", 1), signal.SIGKILL)
    assert cluster.wait_job_end(job, 60) != 0
    assert "every host is blacklisted" in cluster.output("elasticctl-run")
    wait_for(lambda: not cluster.leftover_workers(), 15, "workers stopped")
