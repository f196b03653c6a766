"""The host's fork server (issue 23), with real agents, zygotes and workers: a forked worker is the process a spawned
one would be; a crash is replaced by a fork, with or without a standby, and by a spawn with `--no-fork-server`; a zygote
killed mid-job is started again and the next replacement still starts; one that keeps dying is given up and the job
spawns; forked workers die with their agent; a `--preload` that is not fork-safe (a thread at import) or not importable
falls back to spawning with one line, and the job runs; `elasticctl status` shows each host's fork server, and a host
that spawns says why once in the job's output (issue 31)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest

from elastic_control_plane.elasticctl.local_processes import agent_argv
from testing.harness import Cluster, wait_for, worker_pid
from tests.integration.test_crashes import HOSTS, assert_one_process_per_rank, processes_of, start_job
from tests.integration.training import assert_training_invariants, steps

REPORT = [sys.executable, "tests/workers/process_report.py"]
# What differs between two jobs of one cluster whatever starts their workers.
PER_JOB = (
    "ELASTIC_JOB",
    "ELASTIC_JOB_KEY",
    "ELASTIC_SNAPSHOT",
    "REPORT_DIR",
    "ELASTIC_WAIT_RECORD",  # each worker's own wait record and stack file
    "ELASTIC_STACK_FILE",
)


def agent_log(cluster: Cluster, host: str) -> list[dict]:
    events = []
    for line in cluster.output(f"agent-{host}").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def logged(cluster: Cluster, host: str, event: str) -> list[dict]:
    return [e for e in agent_log(cluster, host) if e.get("event") == event]


def kill_and_wait_for_the_replacement(cluster: Cluster, log_dir: Path, host: str) -> int:
    """SIGKILL the host's worker, wait until a new process trains in its slot at full size; the victim's pid."""
    victim = worker_pid(cluster, host, 0)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    wait_for(
        lambda: any(
            e["size"] == 3 and e["host"] == host and e["pid"] != victim and e["time"] > killed_at
            for e in steps(log_dir)
        ),
        60,
        f"{host}'s replacement training at full size",
    )
    return victim


def run_report_job(cluster: Cluster, tmp_path: Path, name: str, *options: str) -> dict[int, dict]:
    reports = tmp_path / name
    reports.mkdir()
    job = cluster.submit(
        "--min-np", "2", "--env", f"REPORT_DIR={reports}", *options, "--", *REPORT, name=f"elasticctl-{name}"
    )
    assert cluster.wait_job_end(job, 120) == 0, cluster.output(f"elasticctl-{name}") + cluster.dump_logs()
    return {int(path.stem): json.loads(path.read_text()) for path in reports.glob("*.json")}


def without_per_job(env: dict[str, str]) -> dict[str, str]:
    return {name: value for name, value in env.items() if name not in PER_JOB}


@pytest.mark.parametrize("launched", ["from a terminal", "in the background"])
def test_a_forked_worker_is_the_process_a_spawned_one_would_be(cluster: Cluster, tmp_path: Path, launched: str) -> None:
    if launched == "from a terminal":
        agent = cluster.start_agent("host-1", 2, ["--standby", "0"])
    else:  # `elastic-agent ... &` in a script: the agent inherits SIGINT and SIGQUIT ignored
        agent_command = shlex.join(agent_argv("host-1", 2))
        agent = cluster.spawn("agent-host-1", ["sh", "-c", f"trap '' INT QUIT; exec {agent_command} --standby 0"])
        wait_for(lambda: any(h["host"] == "host-1" for h in cluster.call("discovery", "hosts")["all"]), 20, "host-1")
    forked = run_report_job(cluster, tmp_path, "forked")
    spawned = run_report_job(cluster, tmp_path, "spawned", "--no-fork-server")
    started = logged(cluster, "host-1", "worker_started")
    assert [e["forked"] for e in started] == [True, True, False, False], started
    assert sorted(forked) == sorted(spawned) == [0, 1]
    for local_rank in (0, 1):
        f, s = forked[local_rank], spawned[local_rank]
        for report in (f, s):
            assert report["ppid"] == agent.pid, "the agent waits for its workers: they are its children"
            assert report["sid"] == report["pgid"] == report["pid"], "each worker leads a session of its own"
            assert report["name"] == "__main__"
        for fact in ("cwd", "argv", "path0", "signals", "rlimits", "umask", "torch_threads", "proc_cmdline"):
            assert f[fact] == s[fact], (fact, f[fact], s[fact])
        assert without_per_job(f["env"]) == without_per_job(s["env"])
        assert [v for v in f["proc_environ"] if v.split("=")[0] not in PER_JOB] == [
            v for v in s["proc_environ"] if v.split("=")[0] not in PER_JOB
        ]
    for reports in (forked, spawned):
        for generator in ("python_random", "numpy_random"):
            assert reports[0][generator] != reports[1][generator], f"two workers drew the same {generator} number"
    exits = logged(cluster, "host-1", "worker_exited")
    assert [e["exit_code"] for e in exits] == [0, 0, 0, 0], exits


@pytest.mark.parametrize("fork_server", ["fork server", "no fork server"])
def test_a_crashed_worker_is_replaced_without_a_standby(cluster: Cluster, tmp_path: Path, fork_server: str) -> None:
    options = () if fork_server == "fork server" else ("--no-fork-server",)
    job, log_dir = start_job(cluster, tmp_path, *options, agent_args=("--standby", "0"), epochs=12)
    victim = kill_and_wait_for_the_replacement(cluster, log_dir, "host-3")
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    assert_one_process_per_rank(log_dir)
    exited = [e for e in logged(cluster, "host-3", "worker_exited") if e["pid"] == victim]
    assert [e["exit_code"] for e in exited] == [-signal.SIGKILL], exited
    replacement = [e for e in logged(cluster, "host-3", "worker_started") if e["pid"] != victim]
    assert replacement and all(e["forked"] == (fork_server == "fork server") for e in replacement), replacement
    assert not logged(cluster, "host-3", "standby_started")


def test_a_killed_fork_server_is_started_again_and_the_next_replacement_still_starts(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, log_dir = start_job(cluster, tmp_path, agent_args=("--standby", "0"), epochs=12)
    zygote = logged(cluster, "host-2", "fork_server_starting")[-1]["pid"]
    os.kill(zygote, signal.SIGKILL)
    wait_for(lambda: logged(cluster, "host-2", "fork_server_died"), 30, "host-2's agent to see its fork server die")
    wait_for(lambda: len(logged(cluster, "host-2", "fork_server_starting")) == 2, 10, "a new fork server")
    victim = kill_and_wait_for_the_replacement(cluster, log_dir, "host-2")
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    replacement = logged(cluster, "host-2", "worker_started")[-1]
    assert replacement["pid"] != victim and replacement["forked"], replacement


def test_a_fork_server_that_keeps_dying_is_given_up_and_the_rest_of_the_job_spawns(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, log_dir = start_job(cluster, tmp_path, agent_args=("--standby", "0"), epochs=12)
    for deaths in (1, 2, 3):  # the second and third die while they import
        zygote = wait_for(
            lambda: len(started := logged(cluster, "host-2", "fork_server_starting")) == deaths and started[-1]["pid"],
            30,
            f"host-2's fork server number {deaths}",
        )
        os.kill(zygote, signal.SIGKILL)
        wait_for(
            lambda: len(logged(cluster, "host-2", "fork_server_died")) == deaths,
            30,
            f"host-2's agent to see fork server {deaths} die",
        )
    assert [e["deaths"] for e in logged(cluster, "host-2", "fork_server_given_up")] == [3]
    victim = kill_and_wait_for_the_replacement(cluster, log_dir, "host-2")
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    replacement = logged(cluster, "host-2", "worker_started")[-1]
    assert replacement["pid"] != victim and not replacement["forked"], replacement
    assert len(logged(cluster, "host-2", "fork_server_starting")) == 3, (
        "a given-up fork server is not started again in the job"
    )
    assert [e["forked"] for e in logged(cluster, "host-3", "worker_started")] == [True], (
        "another host's fork server is its own"
    )


def test_forked_workers_die_with_their_agent_not_with_their_fork_server(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_job(cluster, tmp_path, agent_args=(), epochs=12)
    wait_for(
        lambda: logged(cluster, "host-3", "standby_waiting"), 60, "host-3's standby (the default) waiting in init()"
    )
    forked = processes_of(cluster, "host-3")
    zygote = logged(cluster, "host-3", "fork_server_starting")[-1]["pid"]
    assert len(forked) == 2 and zygote not in forked, forked
    agent = cluster.processes["agent-host-3"]
    agent.kill()
    agent.wait()
    wait_for(
        lambda: not processes_of(cluster, "host-3") and not Path(f"/proc/{zygote}").exists(),
        10,
        "host-3's worker, standby and fork server gone",
    )
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)


@pytest.mark.parametrize("preload", ["tests.workers.thread_at_import", "no_such_module_anywhere"])
def test_a_preload_that_cannot_be_forked_falls_back_to_spawning_with_one_line(
    cluster: Cluster, tmp_path: Path, preload: str
) -> None:
    job, log_dir = start_job(cluster, tmp_path, "--preload", preload, agent_args=("--standby", "0"), epochs=2)
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert_training_invariants(log_dir)
    for host in HOSTS:
        unavailable = logged(cluster, host, "fork_server_unavailable")
        assert len(unavailable) == 1, unavailable
        reason = unavailable[0]["reason"]
        assert (
            ("metrics-flusher" in reason)
            if preload.startswith("tests")
            else ("No module named 'no_such_module_anywhere'" in reason)
        ), reason
        assert [e["forked"] for e in logged(cluster, host, "worker_started")] == [False], host


def hosts_in_status(cluster: Cluster) -> dict[str, dict]:
    result = cluster.elasticctl("status", "--json")
    assert result.returncode == 0, result.stderr
    return {h["host"]: h for h in json.loads(result.stdout)["hosts"]}


def spawning_lines(cluster: Cluster, host: str) -> list[str]:
    return [
        line for line in cluster.output(f"agent-{host}").splitlines() if "workers start as fresh interpreters" in line
    ]


def test_status_shows_each_hosts_fork_server_and_a_host_that_spawns_says_why_once(
    cluster: Cluster, tmp_path: Path
) -> None:
    job, log_dir = start_job(
        cluster, tmp_path, "--preload", "no_such_module_anywhere", agent_args=("--standby", "0"), epochs=12
    )
    why = "--preload no_such_module_anywhere: ModuleNotFoundError: No module named 'no_such_module_anywhere'"
    wait_for(
        lambda: all(
            h["fork_server"] == {"state": "unavailable", "reason": why} for h in hosts_in_status(cluster).values()
        ),
        30,
        "every host's fork server shown unavailable",
    )
    table = cluster.elasticctl("status").stdout
    host_rows = {}
    for line in table.splitlines():
        host_rows.setdefault(line.split(" ", 1)[0], line)  # the hosts' table comes before the workers'
    assert "FORK SERVER" in host_rows["HOST"], table
    assert all(
        " unavailable " in host_rows[host] and host_rows[host].endswith(f"workers spawn: {why}") for host in HOSTS
    ), table
    kill_and_wait_for_the_replacement(cluster, log_dir, "host-2")
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    for host in HOSTS:
        assert spawning_lines(cluster, host) == [
            f"[{host}] workers start as fresh interpreters (seconds per restart): {why}"
        ], "once per host, a replacement included"
    wait_for(
        lambda: all(h["fork_server"]["state"] == "ready" for h in hosts_in_status(cluster).values()),
        60,
        "between jobs, each agent's own interpreter's fork server ready again",
    )


def test_status_shows_ready_fork_servers_and_nothing_is_said_while_they_serve(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_job(cluster, tmp_path, agent_args=("--standby", "0"), epochs=2)
    assert {h["fork_server"]["state"] for h in hosts_in_status(cluster).values()} == {"ready"}
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert not any(spawning_lines(cluster, host) for host in HOSTS)
    started = [e["forked"] for host in HOSTS for e in logged(cluster, host, "worker_started")]
    assert started == [True] * 3, started


def test_an_agent_readies_its_own_interpreters_fork_server_before_any_job_and_the_job_forks_from_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    cluster.start_agent("host-1", 2, ["--standby", "0"])
    wait_for(
        lambda: hosts_in_status(cluster)["host-1"]["fork_server"] == {"state": "ready", "reason": ""},
        60,
        "host-1's fork server ready with no job",
    )
    zygote = logged(cluster, "host-1", "fork_server_starting")
    assert [e["python"] for e in zygote] == [sys.executable], (
        "started as the agent's interpreter is named (a virtualenv's python in CI)"
    )
    run_report_job(cluster, tmp_path, "first")
    assert [e["forked"] for e in logged(cluster, "host-1", "worker_started")] == [True, True]
    assert len(logged(cluster, "host-1", "fork_server_starting")) == 1, (
        "the job's workers came from the zygote the agent readied"
    )
