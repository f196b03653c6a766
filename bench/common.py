"""Shared pieces of the benchmarks: a cluster in a temporary directory, event reading, medians."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import statistics
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from testing.harness import Cluster, read_events, wait_for

JOB = [sys.executable, "examples/train_elastic.py"]


def _stop(*_: Any) -> None:
    raise SystemExit("benchmark terminated")


@contextlib.contextmanager
def cluster(extra_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    workdir = Path(tempfile.mkdtemp(prefix="elastic-bench-"))
    instance = Cluster(workdir, extra_env)
    signal.signal(signal.SIGTERM, _stop)
    finished = False
    try:
        instance.start_services()
        yield instance
        finished = True
    finally:
        instance.close()
        if finished:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"(the cluster's logs are kept in {workdir})", file=sys.stderr, flush=True)


def steps(log_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_events(log_dir) if e["event"] == "step"]


def first_step_after(log_dir: Path, after: float, timeout: float = 120.0, **match: Any) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        for event in steps(log_dir):
            if event["time"] > after and all(event.get(k) == v for k, v in match.items()):
                return event
        return None

    return wait_for(find, timeout, f"a step after {after} matching {match}")


def steady_step_seconds(log_dir: Path, rank: int = 0) -> float:
    """Median time between consecutive steps of one rank in round 1, before any change: the baseline."""
    times = [e["time"] for e in steps(log_dir) if e["rank"] == rank and e["round"] == 1]
    return statistics.median(b - a for a, b in zip(times, times[1:]))


def warm_up(log_dir: Path, count: int = 30) -> None:
    """Wait until round 1 has `count` steps, so the baseline has enough samples."""
    wait_for(
        lambda: sum(e["round"] == 1 and e["rank"] == 0 for e in steps(log_dir)) >= count,
        120,
        f"{count} steps of round 1",
    )


def log_time(cluster: Cluster, service: str, event: str, after: float) -> float | None:
    """Wall time of the first `event` line in a service's JSON log after `after`."""
    for line in cluster.output(service).splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == event:
            stamp = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
            if stamp > after:
                return stamp
    return None


def report(title: str, samples: dict[str, list[float]], baseline: float) -> None:
    print(f"\n{title}")
    print(f"  baseline: steady step time {baseline * 1000:.1f} ms (median, same run)")
    for name, values in samples.items():
        median = statistics.median(values)
        print(
            f"  {name:<38} median {median:7.3f} s   ({median / baseline:6.1f} x step)   samples "
            f"{', '.join(f'{v:.3f}' for v in values)}"
        )
