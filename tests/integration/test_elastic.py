"""Elasticity with real processes: hosts join, leave and drain while the example trains (issue 3's done-when list)."""

from __future__ import annotations

import os
import signal
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from tests.harness import Cluster, read_events, wait_for

JOB = [sys.executable, "examples/train_elastic.py"]


def _script(tmp_path: Path, hosts: list[str]) -> tuple[Path, Path]:
    listing = tmp_path / "hosts.txt"
    listing.write_text("".join(f"{h}:2\n" for h in hosts))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    return script, listing


def _steps(log_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == "step"]


def _sizes_in_order(log_dir: Path) -> list[int]:
    sizes: list[int] = []
    for event in _steps(log_dir):
        if not sizes or sizes[-1] != event["size"]:
            sizes.append(event["size"])
    return sizes


def _wait_for_size(log_dir: Path, size: int, after: float = 0.0, timeout: float = 90.0) -> None:
    wait_for(lambda: any(e["size"] == size and e["time"] > after for e in _steps(log_dir)), timeout, f"steps at world size {size}")


def assert_training_invariants(log_dir: Path) -> None:
    """Committed steps never go backwards, ranks agree on parameters, and no sample is processed twice in an
    epoch, except in steps a failure rolled back (the model forgot them too)."""
    events = read_events(log_dir)
    last_commit = 0
    for event in events:
        if event["event"] == "commit":
            assert event["step"] >= last_commit, f"committed step went back from {last_commit} to {event['step']}"
            last_commit = event["step"]
        if event["event"] == "enter":
            assert event["step"] >= last_commit, f"round {event['round']} resumed at step {event['step']} before commit {last_commit}"
    entries: dict[int, set[str]] = defaultdict(set)
    for event in events:
        if event["event"] == "enter":
            entries[event["round"]].add(str(event["checksum"]))
    for round_number, checksums in entries.items():
        assert len(checksums) == 1, f"ranks of round {round_number} entered with different parameters"
    resumed_at = {e["round"]: e["step"] for e in events if e["event"] == "enter"}
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for event in events:
        later_rounds = [r for r in resumed_at if r > event["round"]]
        rolled_back = later_rounds and event["step"] > resumed_at[min(later_rounds)]
        if event["event"] == "step" and not rolled_back:
            per_epoch[event["epoch"]].extend(event["indices"])
    for epoch, seen in per_epoch.items():
        duplicates = {i for i in seen if seen.count(i) > 1}
        assert not duplicates, f"epoch {epoch}: indices processed twice: {sorted(duplicates)[:10]}"
    done = [e for e in events if e["event"] == "done"]
    assert done and all(e["identical"] for e in done)


def test_discovery_script_changes_drive_the_world_size(cluster: Cluster, tmp_path: Path) -> None:
    for host in ("host-1", "host-2", "host-3"):
        cluster.start_agent(host, 2)
    script, listing = _script(tmp_path, ["host-1", "host-2"])
    log_dir = tmp_path / "train"
    job = cluster.submit("--min-np", "2", "--max-np", "6", "--discovery-script", str(script), "--", *JOB, "--epochs", "4", "--samples", "768", "--step-delay", "0.03", "--log-dir", str(log_dir))
    _wait_for_size(log_dir, 4)
    listing.write_text("host-1:2\nhost-2:2\nhost-3:2\n")
    _wait_for_size(log_dir, 6)
    listing.write_text("host-1:2\n")
    _wait_for_size(log_dir, 2)
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert _sizes_in_order(log_dir) == [4, 6, 2]
    assert {e["host"] for e in _steps(log_dir) if e["rank"] == 0} == {"host-1"}
    assert_training_invariants(log_dir)
    epochs = [e for e in read_events(log_dir) if e["event"] == "epoch_end" and e["rank"] == 0]
    assert [e["epoch"] for e in epochs] == [0, 1, 2, 3]


def test_every_sample_once_across_world_size_changes_within_an_epoch(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2)
    cluster.start_agent("host-2", 2)
    log_dir = tmp_path / "train"
    job = cluster.submit("--min-np", "2", "--", *JOB, "--epochs", "1", "--samples", "600", "--batch-size", "4", "--step-delay", "0.05", "--log-dir", str(log_dir))
    _wait_for_size(log_dir, 4)
    cluster.elasticctl("drain", "host-2")
    _wait_for_size(log_dir, 2)
    cluster.elasticctl("undrain", "host-2")
    started = max(e["time"] for e in _steps(log_dir))
    _wait_for_size(log_dir, 4, after=started)
    assert cluster.wait_job_end(job, 180) == 0, cluster.output("elasticctl-run")
    assert _sizes_in_order(log_dir) == [4, 2, 4]
    seen = [i for e in _steps(log_dir) for i in e["indices"]]
    assert sorted(seen) == list(range(600)), "every sample index exactly once in the epoch"
    assert_training_invariants(log_dir)


def test_drain_leaves_at_a_commit_without_rollback_and_undrain_brings_it_back(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2)
    cluster.start_agent("host-2", 2)
    log_dir = tmp_path / "train"
    job = cluster.submit("--min-np", "2", "--", *JOB, "--epochs", "3", "--step-delay", "0.03", "--log-dir", str(log_dir))
    _wait_for_size(log_dir, 4)
    host2_pids = {e["pid"] for e in _steps(log_dir) if e["host"] == "host-2"}
    result = cluster.elasticctl("drain", "host-2")
    assert result.returncode == 0 and "draining" in result.stdout
    _wait_for_size(log_dir, 2)
    wait_for(lambda: next(h for h in cluster.status()["hosts"] if h["host"] == "host-2")["state"] == "drained", 30, "host-2 drained")
    for pid in host2_pids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    restores = [e for e in read_events(log_dir) if e["event"] == "enter" and e["round"] == 2]
    assert restores and all(e["host"] == "host-1" for e in restores)
    cluster.elasticctl("undrain", "host-2")
    started = max(e["time"] for e in _steps(log_dir))
    _wait_for_size(log_dir, 4, after=started)
    assert cluster.wait_job_end(job, 180) == 0
    assert_training_invariants(log_dir)


def test_new_agent_joins_and_sigterm_removes_its_host_gracefully(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2)
    log_dir = tmp_path / "train"
    job = cluster.submit("--min-np", "2", "--", *JOB, "--epochs", "3", "--step-delay", "0.03", "--log-dir", str(log_dir))
    _wait_for_size(log_dir, 2)
    cluster.start_agent("host-3", 2)
    _wait_for_size(log_dir, 4)
    assert cluster.stop("agent-host-3", signal.SIGTERM, timeout=60) == 0
    started = max(e["time"] for e in _steps(log_dir))
    _wait_for_size(log_dir, 2, after=started)
    assert cluster.wait_job_end(job, 180) == 0
    assert _sizes_in_order(log_dir) == [2, 4, 2]
    assert {e["host"] for e in _steps(log_dir) if e["rank"] == 0} == {"host-1"}
    assert_training_invariants(log_dir)
    assert os.path.exists(cluster.workdir / "run")


def test_hosts_beyond_max_np_coming_and_going_cause_no_reset(cluster: Cluster, tmp_path: Path) -> None:
    cluster.start_agent("host-1", 2)
    cluster.start_agent("host-2", 2)
    log_dir = tmp_path / "train"
    job = cluster.submit("--min-np", "2", "--max-np", "4", "--", *JOB, "--epochs", "3", "--step-delay", "0.03", "--log-dir", str(log_dir))
    _wait_for_size(log_dir, 4)
    cluster.start_agent("host-3", 2)
    joined_at = max(e["time"] for e in _steps(log_dir))
    wait_for(lambda: sum(e["time"] > joined_at and e["rank"] == 0 for e in _steps(log_dir)) >= 8, 60, "8 more steps after host-3 joined")
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
    assert {e["size"] for e in _steps(log_dir)} == {4}


def test_below_min_np_past_the_elastic_timeout_the_job_fails_clearly(cluster: Cluster) -> None:
    cluster.start_agent("host-1", 2)
    job = cluster.submit("--min-np", "3", "--elastic-timeout", "1", "--", sys.executable, "examples/train.py")
    assert cluster.wait_job_end(job, 30) != 0
    assert "timed out after 1s waiting for 3 slot(s); 2 available" in cluster.output("elasticctl-run")
