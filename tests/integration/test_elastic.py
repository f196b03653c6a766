"""Elasticity with real processes: hosts join, leave and drain while the example trains (issue 3's done-when list)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from testing.harness import Cluster, read_events, wait_for
from tests.integration.training import (
    JOB,
    assert_training_invariants,
    discovery_script,
    sizes_in_order,
    start_training,
    steps,
    wait_for_size,
)


def test_discovery_script_changes_drive_the_world_size(cluster: Cluster, tmp_path: Path) -> None:
    for host in ("host-1", "host-2", "host-3"):
        cluster.start_agent(host, 2)
    script, listing = discovery_script(tmp_path, ["host-1", "host-2"])
    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--min-np",
        "2",
        "--max-np",
        "6",
        "--discovery-script",
        str(script),
        "--",
        *JOB,
        "--epochs",
        "4",
        "--samples",
        "768",
        "--step-delay",
        "0.03",
        "--log-dir",
        str(log_dir),
    )
    wait_for_size(log_dir, 4)
    listing.write_text("host-1:2\nhost-2:2\nhost-3:2\n")
    wait_for_size(log_dir, 6)
    listing.write_text("host-1:2\n")
    wait_for_size(log_dir, 2)
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert sizes_in_order(steps(log_dir)) == [4, 6, 2]
    assert {e["host"] for e in steps(log_dir) if e["rank"] == 0} == {"host-1"}
    assert_training_invariants(log_dir)
    epochs = [e for e in read_events(log_dir) if e["event"] == "epoch_end" and e["rank"] == 0]
    assert [e["epoch"] for e in epochs] == [0, 1, 2, 3]


def test_every_sample_once_across_world_size_changes_within_an_epoch(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2)
    cluster.start_agent("host-2", 2)
    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--min-np",
        "2",
        "--",
        *JOB,
        "--epochs",
        "1",
        "--samples",
        "600",
        "--batch-size",
        "4",
        "--step-delay",
        "0.05",
        "--log-dir",
        str(log_dir),
    )
    wait_for_size(log_dir, 4)
    cluster.elasticctl("drain", "host-2")
    wait_for_size(log_dir, 2)
    cluster.elasticctl("undrain", "host-2")
    started = max(e["time"] for e in steps(log_dir))
    wait_for_size(log_dir, 4, after=started)
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert sizes_in_order(steps(log_dir)) == [4, 2, 4]
    seen = [i for e in steps(log_dir) for i in e["indices"]]
    assert sorted(seen) == list(range(600)), "every sample index exactly once in the epoch"
    assert_training_invariants(log_dir)


def test_drain_leaves_at_a_commit_without_rollback_and_undrain_brings_it_back(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_training(cluster, tmp_path, step_delay=0.03)
    host2_pids = wait_for(
        lambda: len(pids := {e["pid"] for e in steps(log_dir) if e["host"] == "host-2"}) >= 2 and pids,
        30,
        "both of host-2's workers to step",
    )
    result = cluster.elasticctl("drain", "host-2")
    assert result.returncode == 0 and "draining" in result.stdout
    wait_for_size(log_dir, 2)
    wait_for(
        lambda: next(h for h in cluster.status()["hosts"] if h["host"] == "host-2")["state"] == "drained",
        30,
        "host-2 drained",
    )
    for pid in host2_pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    restores = [e for e in read_events(log_dir) if e["event"] == "enter" and e["round"] == 2]
    assert restores and all(e["host"] == "host-1" for e in restores)
    cluster.elasticctl("undrain", "host-2")
    started = max(e["time"] for e in steps(log_dir))
    wait_for_size(log_dir, 4, after=started)
    assert cluster.wait_job_end(job, 180) == 0
    assert_training_invariants(log_dir)


def test_new_agent_joins_and_sigterm_removes_its_host_gracefully(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2)
    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--min-np", "2", "--", *JOB, "--epochs", "6", "--step-delay", "0.03", "--log-dir", str(log_dir)
    )
    wait_for_size(log_dir, 2)
    cluster.start_agent("host-3", 2)
    wait_for_size(log_dir, 4)
    assert cluster.output("agent-host-3").count('"warming": true') == 2, "host-3 started its workers before it counted"
    warm_pids = wait_for(
        lambda: len(pids := {e["pid"] for e in steps(log_dir) if e["host"] == "host-3"}) >= 2 and pids,
        30,
        "both of host-3's workers to step",
    )
    assert len(warm_pids) == 2
    assert cluster.stop("agent-host-3", signal.SIGTERM, timeout=60) == 0
    started = max(e["time"] for e in steps(log_dir))
    wait_for_size(log_dir, 2, after=started)
    assert cluster.wait_job_end(job, 180) == 0
    assert sizes_in_order(steps(log_dir)) == [2, 4, 2]
    assert {e["host"] for e in steps(log_dir) if e["rank"] == 0} == {"host-1"}
    assert_training_invariants(log_dir)


def test_hosts_beyond_max_np_coming_and_going_cause_no_reset(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_training(cluster, tmp_path, "--max-np", "4", step_delay=0.03)
    cluster.start_agent("host-3", 2)
    joined_at = max(e["time"] for e in steps(log_dir))
    wait_for(
        lambda: sum(e["time"] > joined_at and e["rank"] == 0 for e in steps(log_dir)) >= 8,
        60,
        "8 more steps after host-3 joined",
    )
    cluster.stop("agent-host-3", signal.SIGTERM)
    assert cluster.wait_job_end(job, 120) == 0
    assert {e["round"] for e in read_events(log_dir)} == {1}, "no new round for a host beyond max_np"
    assert cluster.job()["resets"] == 0


def test_below_min_np_the_job_waits_then_starts_when_slots_arrive(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2)
    log_dir = tmp_path / "train"
    job = cluster.submit("--min-np", "4", "--", *JOB, "--epochs", "1", "--log-dir", str(log_dir))
    wait_for(lambda: cluster.job()["state"] == "waiting", 10, "the job to wait for slots")
    assert not cluster.leftover_workers()
    cluster.start_agent("host-2", 2)
    assert cluster.wait_job_end(job, 120) == 0
    assert {e["size"] for e in steps(log_dir)} == {4}


def test_below_min_np_past_the_elastic_timeout_the_job_fails_clearly(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 2)
    job = cluster.submit("--min-np", "3", "--elastic-timeout", "1", "--", sys.executable, "examples/train.py")
    assert cluster.wait_job_end(job, 30) != 0
    assert "timed out after 1s waiting for 3 slot(s); 2 available" in cluster.output("elasticctl-run")


def test_draining_the_host_of_rank_0_moves_rank_0_without_losing_state(cluster: Cluster, tmp_path: Path) -> None:
    job, log_dir = start_training(cluster, tmp_path, epochs=4)
    cluster.elasticctl("drain", "host-1")
    wait_for_size(log_dir, 2)
    drained_at = max(e["time"] for e in steps(log_dir))
    cluster.elasticctl("undrain", "host-1")
    wait_for_size(log_dir, 4, after=drained_at)
    assert cluster.wait_job_end(job, 180) == 0
    assert sizes_in_order(steps(log_dir)) == [4, 2, 4]
    rank0_hosts = [e["host"] for e in steps(log_dir) if e["rank"] == 0]
    assert rank0_hosts[0] == "host-1" and rank0_hosts[-1] == "host-2", (
        "rank 0 moved to the oldest surviving host and stayed"
    )
    assert_training_invariants(log_dir)


def test_a_drain_while_the_first_round_forms_is_folded_into_it(cluster: Cluster, tmp_path: Path) -> None:
    for host in ("host-1", "host-2", "host-3"):
        cluster.start_agent(host, 2)
    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--min-np",
        "2",
        "--",
        *JOB,
        "--epochs",
        "1",
        "--samples",
        "96",
        "--step-delay",
        "0.02",
        "--log-dir",
        str(log_dir),
    )
    wait_for(lambda: cluster.job()["round"] == 1, 30, "round 1 to start forming")
    assert not steps(log_dir), "round 1 trained before the drain could meet it forming"
    assert cluster.elasticctl("drain", "host-3").returncode == 0
    assert cluster.wait_job_end(job, 120) == 0, cluster.output("elasticctl-run")
    assert sizes_in_order(steps(log_dir)) == [4], "the drain was folded into the forming round: it never trained at 6"
    assert {e["host"] for e in steps(log_dir)} == {"host-1", "host-2"}
    assert cluster.job()["resets"] == 0
    assert '"replaced": 1' in cluster.output("registry")
    assert_training_invariants(log_dir)
