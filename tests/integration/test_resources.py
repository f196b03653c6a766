"""Resources stay flat over resets (issue 13): a surviving worker's file descriptors and threads do not grow while
another host's workers are killed again and again, under `ulimit -n 256`.

host-1 and host-2 hold the survivors; host-3's running workers are killed one
after the other (each kill is a reset, and so is each replacement rejoining). The survivor is
measured whenever the job is back at full size, so every sample sees the same
process group shape, and only once the survivor has mapped both slots of its
host snapshot (after two commits); the last sample allows a past round's
group held aside until its pending collective ends (at most the collective
timeout) to go.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from elastic_control_plane.elasticctl.local_processes import agent_argv
from testing.harness import Cluster, read_events, wait_for
from tests.integration.training import JOB, steps, wait_for_size

FD_LIMIT = 256
FULL_SIZE = 4
HELD_ASIDE_MAX = 20 + 120 + 10  # gloo's timeout of a watched worker's group (libworker.world.judged_group_timeout:
# the harness's collective timeout plus the hung timeout), and a margin


def start_agent_with_fd_limit(cluster: Cluster, host: str, slots: int) -> None:
    cluster.spawn(
        f"agent-{host}",
        [
            "sh",
            "-c",
            f'ulimit -n {FD_LIMIT} && exec "$0" "$@"',
            *agent_argv(host, slots),
        ],
    )
    wait_for(
        lambda: any(h["host"] == host for h in cluster.call("discovery", "hosts")["all"]),
        20,
        f"agent {host} to register",
    )


def resources(pid: int) -> tuple[int, int]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    threads = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("Threads:")
    )
    return fds, threads


def settled(pid: int, baseline: tuple[int, int], within: float) -> tuple[int, int]:
    """The process's fds and threads once they are back at `baseline`, or as they are after `within` seconds. A
    round left while one of its collectives still waited on a live peer keeps its group aside until that work
    ends, at the latest at gloo's timeout (libworker.torch_compat.RetiredGroups), so a sample taken right after a
    reset may still count it; a leak never comes back down."""
    deadline = time.monotonic() + within
    while True:
        now = resources(pid)
        if (now[0] <= baseline[0] and now[1] <= baseline[1]) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


def fd_limit(pid: int) -> int:
    line = next(
        line for line in Path(f"/proc/{pid}/limits").read_text().splitlines() if line.startswith("Max open files")
    )
    return int(line.split()[3])


def running_pids(cluster: Cluster, host: str) -> list[int]:
    return [
        int(w["pid"])
        for w in cluster.call("registry", "status")["workers"]
        if w["host"] == host and w["state"] == "RUNNING" and w["pid"]
    ]


def reset_count(cluster: Cluster) -> int:
    return int(cluster.call("registry", "job")["resets"])


@pytest.mark.parametrize("resets", [20, pytest.param(200, marks=pytest.mark.slow)])
def test_a_survivor_holds_no_more_fds_or_threads_after_many_resets(
    cluster: Cluster, tmp_path: Path, resets: int
) -> None:
    for host, slots in (("host-1", 1), ("host-2", 1), ("host-3", 2)):
        start_agent_with_fd_limit(cluster, host, slots)
    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--min-np",
        "2",
        "--blacklist-cooldown",
        "0",
        "0",
        "--max-restarts",
        "100000",
        "--restart-window",
        "0.001",
        "--",
        *JOB,
        "--epochs",
        "100000",
        "--samples",
        "256",
        "--log-dir",
        str(log_dir),
    )
    wait_for_size(log_dir, FULL_SIZE)
    survivor = running_pids(cluster, "host-1")[0]
    assert fd_limit(survivor) == FD_LIMIT

    def at_full_size_after(reset: int) -> tuple[int, int]:
        wait_for(
            lambda: (
                reset_count(cluster) >= reset
                and cluster.call("registry", "job")["size"] == FULL_SIZE
                and len(running_pids(cluster, "host-3")) == 2
            ),
            60,
            f"full size after reset {reset}",
        )
        latest = wait_for(
            lambda: [
                e
                for e in steps(log_dir)
                if e["pid"] == survivor and e["round"] == cluster.call("registry", "job")["round"]
            ],
            30,
            "the survivor training in the current round",
        )
        assert latest[-1]["size"] == FULL_SIZE
        return resources(survivor)

    def kill_until(target: int) -> None:
        """Kill a running worker of host-3 after every reset (its other slot's replacement may still be starting),
        until the job has been reset `target` times."""
        while reset_count(cluster) < target:
            victims = wait_for(lambda: running_pids(cluster, "host-3"), 60, "a running worker on host-3")
            before = reset_count(cluster)
            try:
                os.kill(victims[0], signal.SIGKILL)
            except ProcessLookupError:
                continue
            wait_for(lambda: reset_count(cluster) > before, 30, "the reset after a kill")

    kill_until(4)
    # Kills can come faster than commits: the first sample waits until the survivor has written its host snapshot's
    # two buffers, which it keeps mapped from then on (a descriptor and the mapping's own, each).
    wait_for(
        lambda: sum(e["event"] == "commit" and e["pid"] == survivor for e in read_events(log_dir)) >= 2,
        60,
        "the survivor's first two commits",
    )
    baseline = at_full_size_after(4)
    kill_until(resets)
    at_full_size_after(resets)
    final = settled(survivor, baseline, HELD_ASIDE_MAX)
    print(f"survivor fds/threads after reset 4: {baseline}, after reset {reset_count(cluster)}: {final}")
    assert job.poll() is None, cluster.output("elasticctl-run")
    assert survivor in running_pids(cluster, "host-1"), "the survivor kept training through every reset"
    assert final[0] <= baseline[0], f"survivor fds grew from {baseline[0]} to {final[0]} over {resets} resets"
    assert final[1] <= baseline[1], f"survivor threads grew from {baseline[1]} to {final[1]} over {resets} resets"
    cluster.call("registry", "cancel", {"reason": "test done"})
    assert cluster.wait_job_end(job, 30) != 0
