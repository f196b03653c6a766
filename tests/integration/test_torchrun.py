"""torchrun scripts run unchanged (issue 22): `--mode torchrun` and `elasticctl torchrun` on real services, agents
and workers.

- every torchrun variable a worker sees is what torchrun itself sets for the same layout (torchrun is run beside
  it), but for the store's address and the run id;
- a killed worker, a lost host, an added host and a drain each start every worker again in a new round, every
  rank from the last save (in host memory, or the script's own file; DDP, and FSDP on gloo) with identical
  parameters; the reset
  limit counts the restarts after a failure only, as torchrun's --max-restarts;
- the reset limit is torchrun's --max-restarts: TORCHELASTIC_RESTART_COUNT counts the rounds, and a script that
  fails in every round ends the job after that many restarts;
- `elasticctl torchrun` runs torchrun's launch line and refuses, in one line, a flag it does not support.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from testing.harness import REPO, Cluster, read_events, wait_for

ENV_SCRIPT = "tests/workers/torchrun_env.py"
NOT_COMPARED = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


def recorded(directory: Path) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("rank-*.json"))}


def ddp(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "examples/ddp_train.py", "--log-dir", str(tmp_path / "log"), "--save-every", "5", *extra]


def starts(tmp_path: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path / "log") if e["event"] == "start"]


def starts_of_restart(tmp_path: Path, restart: int, size: int) -> list[dict[str, Any]] | None:
    found = [e for e in starts(tmp_path) if e["restart_count"] == restart]
    return found if len(found) == size else None


def saved_steps(tmp_path: Path, restart: int) -> list[int]:
    return [e["step"] for e in read_events(tmp_path / "log") if e["event"] == "saved" and e["restart_count"] == restart]


def assert_resumed_together(round_starts: list[dict[str, Any]], size: int, at_least: int) -> int:
    """Every rank of a round started at the same step (a save at least `at_least`) with identical parameters."""
    assert sorted(e["rank"] for e in round_starts) == list(range(size))
    assert {e["size"] for e in round_starts} == {size}
    steps = {e["step"] for e in round_starts}
    assert len(steps) == 1 and steps.pop() >= at_least, round_starts
    assert len({json.dumps(e["checksum"]) for e in round_starts}) == 1, round_starts
    return round_starts[0]["step"]


def test_every_variable_is_what_torchrun_sets_for_the_same_layout(cluster: Cluster, tmp_path: Path) -> None:
    torchrun = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            ENV_SCRIPT,
            str(tmp_path / "torchrun"),
        ],
        cwd=REPO,
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert torchrun.returncode == 0, torchrun.stderr
    cluster.start_agent("host-1", 2)
    job = cluster.submit(
        "--mode", "torchrun", "--reset-limit", "2", "--", sys.executable, ENV_SCRIPT, str(tmp_path / "ours")
    )
    assert cluster.wait_job_end(job, 120) == 0, cluster.output("elasticctl-run")
    theirs, ours = recorded(tmp_path / "torchrun"), recorded(tmp_path / "ours")
    assert sorted(ours) == sorted(theirs) == ["rank-0-restart-0", "rank-1-restart-0"]
    for name, seen in ours.items():
        assert {k: v for k, v in seen.items() if k not in NOT_COMPARED} == {
            k: v for k, v in theirs[name].items() if k not in NOT_COMPARED
        }
        assert seen["MASTER_ADDR"] == "127.0.0.1" and seen["MASTER_PORT"] == ours["rank-0-restart-0"]["MASTER_PORT"]
        assert seen["TORCHELASTIC_RUN_ID"] == cluster.job()["job_key"]


def test_two_hosts_get_torchruns_ranks_and_group_ranks(cluster: Cluster, tmp_path: Path) -> None:
    for host in ("host-1", "host-2"):
        cluster.start_agent(host, 2)
    job = cluster.submit(
        "--mode", "torchrun", "--env", "OMP_NUM_THREADS=3", "--", sys.executable, ENV_SCRIPT, str(tmp_path / "ours")
    )
    assert cluster.wait_job_end(job, 120) == 0, cluster.output("elasticctl-run")
    seen = recorded(tmp_path / "ours")
    assert len(seen) == 4
    for rank in range(4):
        values = seen[f"rank-{rank}-restart-0"]
        assert values["WORLD_SIZE"] == values["ROLE_WORLD_SIZE"] == "4" and values["ROLE_RANK"] == str(rank)
        assert (values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"]) == (str(rank % 2), "2")
        assert (values["GROUP_RANK"], values["GROUP_WORLD_SIZE"]) == (str(rank // 2), "2")
        assert values["OMP_NUM_THREADS"] == "3", "the job's own setting wins, as under torchrun"
        assert values["TORCHELASTIC_MAX_RESTARTS"] == str(2**31 - 1), "no reset limit: unlimited"
        assert values["allreduce"] == 4.0


@pytest.mark.parametrize("checkpoint", ["host-memory", "file", "fsdp-host-memory"])
def test_a_killed_worker_starts_every_worker_again_from_the_last_save(
    cluster: Cluster, tmp_path: Path, checkpoint: str
) -> None:
    for host in ("host-1", "host-2"):
        cluster.start_agent(host, 1)
    saving = {
        "host-memory": ["--host-memory"],
        "file": ["--checkpoint", str(tmp_path / "ddp.pt")],
        "fsdp-host-memory": ["--fsdp", "--host-memory"],
    }[checkpoint]
    job = cluster.submit("--mode", "torchrun", "--", *ddp(tmp_path, "--steps", "120", "--step-delay", "0.03", *saving))
    wait_for(lambda: max(saved_steps(tmp_path, 0), default=0) >= 10, 90, "the first round to save step 10")
    victim = next(e["pid"] for e in starts(tmp_path) if e["rank"] == 1)
    os.kill(victim, signal.SIGKILL)
    last_saved = max(saved_steps(tmp_path, 0))
    assert cluster.wait_job_end(job, 120) == 0, cluster.output("elasticctl-run")
    second = starts_of_restart(tmp_path, 1, 2)
    assert second is not None, starts(tmp_path)
    assert assert_resumed_together(second, 2, at_least=last_saved) <= last_saved + 5
    assert not starts_of_restart(tmp_path, 2, 1), "one kill, one restart"
    assert {e["pid"] for e in second}.isdisjoint(e["pid"] for e in starts(tmp_path) if e["restart_count"] == 0), (
        "every worker was started again"
    )
    assert cluster.job()["resets"] == 1
    assert "parameters identical on all 2 ranks: True" in cluster.output("agent-host-1")


def agent_events(cluster: Cluster, host: str, event: str) -> list[dict[str, Any]]:
    found = []
    for line in cluster.output(f"agent-{host}").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            try:
                found.append(json.loads(line))
            except ValueError:
                continue
    return [e for e in found if e.get("event") == event]


def test_a_worker_killed_a_second_into_the_job_comes_back_forked_from_the_fork_server(
    cluster: Cluster, tmp_path: Path
) -> None:
    """A crash one second in costs what a crash after an hour costs: the first round's commands and the next round's
    are forked (the supervisors from the host's zygote, the commands from their seeds), none spawned."""
    cluster.start_agent("host-1", 2)
    job = cluster.submit(
        "--mode",
        "torchrun",
        "--",
        *ddp(tmp_path, "--steps", "150", "--step-delay", "0.03", "--checkpoint", str(tmp_path / "ddp.pt")),
    )
    first_step = wait_for(
        lambda: next((e for e in read_events(tmp_path / "log") if e["event"] == "step"), None),
        120,
        "the job's first step",
    )
    wait_for(
        lambda: any(
            e["event"] == "step" and e["time"] >= first_step["time"] + 1.0 for e in read_events(tmp_path / "log")
        ),
        30,
        "a second of training",
    )
    victim = next(e["pid"] for e in starts(tmp_path) if e["rank"] == 1)
    os.kill(victim, signal.SIGKILL)
    assert cluster.wait_job_end(job, 120) == 0, cluster.output("elasticctl-run")
    second = starts_of_restart(tmp_path, 1, 2)
    assert second is not None, starts(tmp_path)
    assert_resumed_together(second, 2, at_least=0)
    started = agent_events(cluster, "host-1", "command_started")
    assert sorted((e["round"], e["local_rank"]) for e in started) == [(1, 0), (1, 1), (2, 0), (2, 1)], started
    assert all(e["forked"] for e in started), started
    assert {e["command_pid"] for e in started if e["round"] == 2} == {e["pid"] for e in second}
    supervisors = agent_events(cluster, "host-1", "worker_started")
    assert [e["forked"] for e in supervisors] == [True, True], supervisors
    assert "parameters identical on all 2 ranks: True" in cluster.output("agent-host-1")


def test_an_added_host_a_drain_and_a_lost_host_each_start_a_new_round(cluster: Cluster, tmp_path: Path) -> None:
    for host in ("host-1", "host-2"):
        cluster.start_agent(host, 1)
    cluster.submit(
        "--mode",
        "torchrun",
        "--min-np",
        "1",
        "--reset-limit",
        "1",
        "--",
        *ddp(tmp_path, "--steps", "100000", "--step-delay", "0.03", "--host-memory"),
    )
    wait_for(lambda: max(saved_steps(tmp_path, 0), default=0) >= 5, 90, "the first round to save")

    cluster.start_agent("host-3", 1)
    added = wait_for(lambda: starts_of_restart(tmp_path, 1, 3), 90, "a round of 3 with the added host")
    assert_resumed_together(added, 3, at_least=5)
    wait_for(lambda: saved_steps(tmp_path, 1), 60, "the round of 3 to save")

    assert cluster.elasticctl("drain", "host-3").returncode == 0
    drained = wait_for(lambda: starts_of_restart(tmp_path, 2, 2), 90, "a round of 2 without the drained host")
    assert_resumed_together(drained, 2, at_least=max(saved_steps(tmp_path, 1)))
    wait_for(lambda: saved_steps(tmp_path, 2), 60, "the round of 2 to save")

    os.kill(cluster.processes["agent-host-2"].pid, signal.SIGKILL)
    alone = wait_for(lambda: starts_of_restart(tmp_path, 3, 1), 90, "a round of 1 without the lost host")
    assert_resumed_together(alone, 1, at_least=max(saved_steps(tmp_path, 2)))
    wait_for(lambda: saved_steps(tmp_path, 3), 60, "the round of 1 to train on")
    assert cluster.job()["state"] == "running", (
        "--reset-limit 1: the host changes did not count, the lost host's failure did, once"
    )


def test_a_script_that_fails_in_every_round_ends_the_job_at_the_reset_limit(cluster: Cluster, tmp_path: Path) -> None:
    for host in ("host-1", "host-2"):
        cluster.start_agent(host, 1)
    job = cluster.submit(
        "--mode",
        "torchrun",
        "--reset-limit",
        "2",
        "--env",
        "CRASH_RANK=1",
        "--",
        sys.executable,
        ENV_SCRIPT,
        str(tmp_path / "ours"),
    )
    assert cluster.wait_job_end(job, 150) == 1, cluster.output("elasticctl-run")
    seen = recorded(tmp_path / "ours")
    assert sorted(name for name in seen if name.startswith("rank-1")) == [
        "rank-1-restart-0",
        "rank-1-restart-1",
        "rank-1-restart-2",
    ]
    assert {values["TORCHELASTIC_MAX_RESTARTS"] for values in seen.values()} == {"2"}
    finished = cluster.job()
    assert (finished["state"], finished["resets"]) == ("failed", 2)
    assert "reset limit 2 reached" in finished["reason"]


def test_elasticctl_torchrun_runs_torchruns_launch_line(tmp_path: Path) -> None:
    local = Cluster(tmp_path)
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "elastic_control_plane.elasticctl.main",
                "torchrun",
                "--nnodes=2",
                "--nproc_per_node",
                "1",
                "--max-restarts",
                "1",
                "--rdzv-backend",
                "c10d",
                "examples/ddp_train.py",
                "--steps",
                "20",
                "--host-memory",
                "--log-dir",
                str(tmp_path / "log"),
            ],
            cwd=REPO,
            env=local.env,
            capture_output=True,
            text=True,
            timeout=180,
        )
    finally:
        local.close()
    assert result.returncode == 0, result.stderr
    assert "parameters identical on all 2 ranks: True" in result.stdout + result.stderr
    assert {(e["rank"], e["size"]) for e in starts(tmp_path)} == {(0, 2), (1, 2)}


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--log-dir", "/tmp/x"], "--log-dir is not supported by elasticctl torchrun"),
        (["--nproc-per-node", "gpu"], "--nproc-per-node wants a whole number of at least 1, got 'gpu'"),
        (["--nnodes", "4:2"], "--nnodes 4:2: MIN must not exceed MAX"),
        (["--rdzv-backend", "etcd"], "--rdzv-backend etcd is not supported"),
    ],
)
def test_elasticctl_torchrun_refuses_what_it_does_not_run_in_one_line(
    tmp_path: Path, flag: list[str], message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "torchrun", *flag, "train.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr, result.stderr
