"""Helpers of the integration tests that train `examples/train_elastic.py`: start a job, read what its ranks logged,
check the invariants of elastic training."""

from __future__ import annotations

import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from testing.harness import Cluster, read_events, wait_for

JOB = [sys.executable, "examples/train_elastic.py"]


def discovery_script(tmp_path: Path, hosts: list[str]) -> tuple[Path, Path]:
    listing = tmp_path / "hosts.txt"
    listing.write_text("".join(f"{h}:2\n" for h in hosts))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {listing}\n")
    script.chmod(0o755)
    return script, listing


def no_stall_bound() -> float:
    """The longest pause a job may show around a fault that it must not wait out: 1 s on an idle machine, more when
    this machine is loaded. What the bound tells apart is a job that waited for a fresh worker process (a whole
    interpreter importing torch) from one that did not; so it is half of what importing torch costs right now,
    measured, and never under 1 s."""
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True)
    return max(1.0, 0.5 * (time.monotonic() - started))


def steps(log_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == "step"]


def sizes_in_order(events: list[dict[str, Any]]) -> list[int]:
    """The world sizes the events were logged at, each run of one size once."""
    sizes: list[int] = []
    for event in events:
        if not sizes or sizes[-1] != event["size"]:
            sizes.append(event["size"])
    return sizes


def wait_for_size(log_dir: Path, size: int, after: float = 0.0, timeout: float = 90.0) -> None:
    wait_for(
        lambda: any(e["size"] == size and e["time"] > after for e in steps(log_dir)),
        timeout,
        f"steps at world size {size}",
    )


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
            assert event["step"] >= last_commit, (
                f"round {event['round']} resumed at step {event['step']} before commit {last_commit}"
            )
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


def start_training(
    cluster: Cluster,
    tmp_path: Path,
    *options: str,
    hosts: tuple[str, ...] = ("host-1", "host-2"),
    epochs: int = 3,
    step_delay: float = 0.02,
) -> tuple[subprocess.Popen[bytes], Path]:
    """Agents with 2 slots each, then the elastic example with --min-np 2; returns once every slot trains."""
    for host in hosts:
        cluster.start_agent(host, 2)
    log_dir = tmp_path / "train"
    job = cluster.submit(
        "--min-np",
        "2",
        *options,
        "--",
        *JOB,
        "--epochs",
        str(epochs),
        "--step-delay",
        str(step_delay),
        "--log-dir",
        str(log_dir),
    )
    wait_for_size(log_dir, 2 * len(hosts))
    return job, log_dir


def host_row(cluster: Cluster, name: str) -> dict[str, Any]:
    return next(h for h in cluster.status()["hosts"] if h["host"] == name)
