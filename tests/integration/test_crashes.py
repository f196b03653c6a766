"""A crashed worker on a healthy host (issue 13): the job keeps training without its slot, the slot restarts in place
and rejoins; a standby takes the slot at once; a slot that crashes on every start is given up and its host
blacklisted, without ever stalling the job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

from elastic_control_plane.elasticctl.local_processes import agent_argv
from testing.harness import Cluster, processes_with_env, read_events, wait_for, worker_pid
from tests.integration.training import (
    JOB,
    assert_training_invariants,
    host_row,
    no_stall_bound,
    steps,
    wait_for_size,
)

HOSTS = ("host-1", "host-2", "host-3")
# These tests start agents with `--standby 0` unless they test standbys: a crashed slot restarts in place (the fork
# server's default standby would take it at once).


CRASHING_JOB = [JOB[0], "tests/workers/crash_at_start.py"]


def start_job(
    cluster: Cluster,
    tmp_path: Path,
    *options: str,
    agent_args: tuple[str, ...] = ("--standby", "0"),
    epochs: int = 8,
    env: dict[str, str] | None = None,
    command: list[str] = JOB,
) -> tuple[subprocess.Popen[bytes], Path]:
    for host in HOSTS:
        cluster.start_agent(host, 1, list(agent_args))
    log_dir = tmp_path / "train"
    extra = [arg for key, value in (env or {}).items() for arg in ("--env", f"{key}={value}")]
    job = cluster.submit(
        "--min-np",
        "2",
        "--blacklist-cooldown",
        "600",
        "600",
        *options,
        *extra,
        "--",
        *command,
        "--epochs",
        str(epochs),
        "--step-delay",
        "0.02",
        "--log-dir",
        str(log_dir),
    )
    wait_for_size(log_dir, 3)
    return job, log_dir


def rank0_step_times(log_dir: Path, after: float) -> list[float]:
    return [e["time"] for e in steps(log_dir) if e["rank"] == 0 and e["time"] > after]


def longest_gap(times: list[float]) -> float:
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def assert_one_process_per_rank(log_dir: Path) -> None:
    holders: dict[tuple[int, int], set[int]] = defaultdict(set)
    for event in steps(log_dir):
        holders[(event["round"], event["rank"])].add(event["pid"])
    shared = {key: pids for key, pids in holders.items() if len(pids) > 1}
    assert not shared, f"(round, rank) held by more than one process: {shared}"


def test_a_crashed_worker_costs_no_stall_and_its_slot_restarts_in_place(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_job(cluster, tmp_path)
    victim = worker_pid(cluster, "host-3", 0)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    # The survivors may train at size 2 meanwhile; a forked replacement is often ready before they re-form.
    wait_for(
        lambda: any(
            e["size"] == 3 and e["host"] == "host-3" and e["pid"] != victim and e["time"] > killed_at
            for e in steps(log_dir)
        ),
        60,
        "host-3's replacement training at full size",
    )
    times, bound = rank0_step_times(log_dir, killed_at - 1.0), no_stall_bound()
    assert longest_gap(times) < bound, (
        f"the job stalled {longest_gap(times):.2f}s around the crash (bound {bound:.2f}s)"
    )
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    assert_one_process_per_rank(log_dir)
    host3 = host_row(cluster, "host-3")
    assert host3["state"] == "active" and not host3["blacklisted"], host3


def processes_of(cluster: Cluster, host: str) -> list[int]:
    """Live processes started by `host`'s agent of this cluster."""
    return processes_with_env(f"ELASTIC_AGENT=ipc://{cluster.workdir / 'run'}/agent-{host}.sock\0")


def standbys_of(cluster: Cluster, host: str) -> list[int]:
    """Live processes started as standbys by `host`'s agent (their environment says so even once admitted)."""
    found = []
    for pid in processes_of(cluster, host):
        try:
            if b"ELASTIC_STANDBY=1\0" in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(pid)
        except OSError:
            continue
    return found


def test_a_standby_takes_the_crashed_slot_and_the_job_is_back_at_full_size_within_a_second(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, log_dir = start_job(
        cluster, tmp_path, agent_args=("--standby", "1"), epochs=16
    )  # long enough to outlast a slow standby start on a loaded machine
    wait_for(lambda: "standby_waiting" in cluster.output("agent-host-2"), 60, "host-2's standby to wait in init()")
    first_standby = standbys_of(cluster, "host-2")
    assert len(first_standby) == 1
    os.kill(first_standby[0], signal.SIGKILL)
    wait_for(
        lambda: cluster.output("agent-host-2").count("standby_waiting") >= 2,
        60,
        "a standby that died while waiting to be replaced",
    )
    assert cluster.output("agent-host-2").count("standby_replaced") == 1
    victim = worker_pid(cluster, "host-2", 0)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: any(
            e["size"] == 3 and e["host"] == "host-2" and e["pid"] != victim and e["time"] > killed_at
            for e in steps(log_dir)
        ),
        30,
        "the standby training in host-2's slot",
    )
    back_at = min(
        e["time"]
        for e in steps(log_dir)
        if e["size"] == 3 and e["host"] == "host-2" and e["pid"] != victim and e["time"] > killed_at
    )
    bound = no_stall_bound()
    assert back_at - killed_at < bound, (
        f"full size again {back_at - killed_at:.2f}s after the crash (bound {bound:.2f}s)"
    )
    assert "standby_admitted" in cluster.output("agent-host-2")
    wait_for(
        lambda: cluster.output("agent-host-2").count("standby_started") >= 2,
        30,
        "a new standby started in the background",
    )
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    assert_one_process_per_rank(log_dir)
    wait_for(lambda: not cluster.leftover_workers(), 15, "standbys stopped with the job")


def test_agent_shutdown_stops_its_standby(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_job(cluster, tmp_path, agent_args=("--standby", "1"), epochs=4)
    wait_for(lambda: standbys_of(cluster, "host-3"), 60, "host-3's standby")
    assert cluster.stop("agent-host-3") == 0
    assert not processes_of(cluster, "host-3")
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")


def test_more_standbys_than_slots_is_refused_with_one_line(cluster: Cluster) -> None:
    agent = cluster.spawn(
        "agent-host-9",
        agent_argv("host-9", 1, "--standby", "2"),
    )
    assert agent.wait(timeout=30) == 2
    lines = cluster.output("agent-host-9").strip().splitlines()
    assert (
        lines[-1]
        == "elastic-agent: --standby 2 is more than this host's 1 slot(s): a host keeps at most one standby per slot"
    ), lines


def test_a_slot_that_crashes_on_every_start_backs_off_then_its_host_is_blacklisted(
    cluster: Cluster, tmp_path: Path
) -> None:
    crash_marker = tmp_path / "crash-at-start"
    job, log_dir = start_job(
        cluster,
        tmp_path,
        "--max-restarts",
        "2",
        "--restart-window",
        "60",
        env={"CRASH_AT_START_IF": str(crash_marker), "CRASH_ON_HOST": "host-3"},
        command=CRASHING_JOB,
    )
    crash_marker.touch()
    killed_at = time.time()
    os.kill(worker_pid(cluster, "host-3", 0), signal.SIGKILL)
    wait_for(lambda: host_row(cluster, "host-3")["blacklisted"], 30, "host-3 blacklisted after its slot crash-looped")
    row = host_row(cluster, "host-3")
    assert "crashed 3 times within 60s" in row["blacklist_reason"], row
    agent_log = cluster.output("agent-host-3")
    assert agent_log.count("slot_restarting") == 2 and "slot_given_up" in agent_log
    times, bound = rank0_step_times(log_dir, killed_at - 1.0), no_stall_bound()
    stall = longest_gap(times)
    assert stall < bound, f"the job stalled {stall:.2f}s while host-3's slot crash-looped (bound {bound:.2f}s)"
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    assert "crashed 3 times" in cluster.elasticctl("status").stdout


def test_max_restarts_zero_keeps_horovods_rule_a_crash_blacklists_the_host(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_job(cluster, tmp_path, "--max-restarts", "0", epochs=4)
    os.kill(worker_pid(cluster, "host-2", 0), signal.SIGKILL)
    wait_for(lambda: host_row(cluster, "host-2")["blacklisted"], 30, "host-2 blacklisted at the first crash")
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert "exited with code -9; crashed; --max-restarts 0" in host_row(cluster, "host-2")["blacklist_reason"]
    assert {e["host"] for e in read_events(log_dir) if e["event"] == "done"} == {"host-1", "host-3"}


def test_an_agent_killed_and_restarted_at_once_costs_its_slots_only_until_its_new_workers_are_ready(
    tmp_path: Path,
) -> None:
    # "At once": before the host counts as lost (the harness's HOST_LOST_AFTER, 2 s), which leaves room for an
    # agent's start on a busy machine.
    cluster = Cluster(tmp_path)
    cluster.start_services()
    try:
        restarted_agent_costs_its_slots_only(cluster, tmp_path)
    finally:
        cluster.close()


def restarted_agent_costs_its_slots_only(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_job(cluster, tmp_path)
    old_worker = worker_pid(cluster, "host-3", 0)
    killed_at = time.time()
    cluster.processes["agent-host-3"].send_signal(signal.SIGKILL)
    cluster.processes["agent-host-3"].wait()
    cluster.start_agent("host-3", 1)
    wait_for_size(log_dir, 2, after=killed_at, timeout=30)
    wait_for(
        lambda: any(
            e["size"] == 3 and e["host"] == "host-3" and e["pid"] != old_worker and e["time"] > killed_at
            for e in steps(log_dir)
        ),
        60,
        "host-3's new worker training at full size",
    )
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    assert not host_row(cluster, "host-3")["blacklisted"]


def test_elasticctl_local_standby_gives_each_agent_a_standby_that_takes_a_crashed_slot(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    log_dir = tmp_path / "train"
    local = cluster.spawn(
        "elasticctl-local",
        [
            sys.executable,
            "-m",
            "elastic_control_plane.elasticctl.main",
            "local",
            "--hosts",
            "2",
            "--slots",
            "1",
            "--standby",
            "1",
            "--",
            *JOB,
            "--epochs",
            "4",
            "--step-delay",
            "0.02",
            "--log-dir",
            str(log_dir),
        ],
    )
    try:
        wait_for(
            lambda: len(standbys_of(cluster, "host-1")) == 1 and len(standbys_of(cluster, "host-2")) == 1,
            90,
            "a standby per agent",
        )
        wait_for_size(log_dir, 2)
        victim = wait_for(
            lambda: next((e["pid"] for e in steps(log_dir) if e["host"] == "host-2"), None),
            30,
            "host-2's worker to step",
        )
        killed_at = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_for(
            lambda: any(
                e["host"] == "host-2" and e["pid"] != victim and e["size"] == 2 and e["time"] > killed_at
                for e in steps(log_dir)
            ),
            30,
            "the standby training in host-2's slot",
        )
        assert local.wait(timeout=180) == 0, cluster.output("elasticctl-local")
        assert_training_invariants(log_dir)
        assert_one_process_per_rank(log_dir)
        assert not cluster.leftover_workers()
    finally:
        if local.poll() is None:
            local.kill()
            local.wait()


def started_pids(cluster: Cluster, host: str) -> list[int]:
    lines = [
        line
        for line in cluster.output(f"agent-{host}").splitlines()
        if line.startswith("{") and '"event": "worker_started"' in line
    ]
    return [json.loads(line)["pid"] for line in lines]


def test_a_given_up_slot_comes_back_when_its_hosts_blacklist_cooldown_ends(cluster: Cluster, tmp_path: Path) -> None:
    """Horovod brings a blacklisted host back when its cooldown ends; a slot given up for crashing must too, or a
    host that had one bad minute is lost to a weeks-long job for good. host-2's worker is SIGKILLed 3 times, each
    time once it trains again, then its next replacement as soon as it starts (while the slot is still down): the
    4th crash within the window is one more than --max-restarts 3."""
    job, log_dir = start_job(cluster, tmp_path, "--blacklist-cooldown", "0", "0", epochs=1000)
    killed: list[int] = []
    for _ in range(3):
        victim = wait_for(
            lambda: (pid := worker_pid(cluster, "host-2", 0)) not in killed and pid,
            60,
            "host-2's worker training again",
        )
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)
    starting = wait_for(
        lambda: [pid for pid in started_pids(cluster, "host-2") if pid not in killed],
        30,
        "host-2's next replacement to start",
    )[0]
    os.kill(starting, signal.SIGKILL)
    killed.append(starting)
    wait_for(lambda: "slot_given_up" in cluster.output("agent-host-2"), 30, "host-2's slot given up")
    back = wait_for(
        lambda: [e for e in steps(log_dir) if e["host"] == "host-2" and e["pid"] not in killed and e["size"] == 3],
        60,
        "host-2 training again after its cooldown",
    )
    assert back[0]["round"] > 1
    assert job.poll() is None
    cluster.call("registry", "cancel", {"reason": "test done"})
    assert cluster.wait_job_end(job, 30) != 0
