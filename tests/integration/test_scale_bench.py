"""The scale benchmark at a few hundred hosts (256 hosts x 8 slots, simulated agents entering rounds one entry per
host against the real services): it runs to the end, every rank it was given is the one `get_host_assignments`
gives (round 1, after the drain, after the lost host), no request was refused, its last line is a complete SCALE
line with sane numbers, and it leaves no process behind."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import uuid

from testing.harness import REPO, processes_with_env

HOSTS, SLOTS = 256, 8
BOUND_S = 30.0  # round_s and reset_s take well under a second here; anything near this is a regression
MARKER = "ELASTIC_SCALE_TEST"  # in the environment of every process the benchmark starts: found if one is left
FIELDS = (
    "hosts",
    "slots",
    "round_s",
    "fanout_p50_ms",
    "fanout_max_ms",
    "reset_s",
    "cpu_s",
    "round_cpu_s",
    "reset_cpu_s",
    "registry_idle_cores",
    "discovery_idle_cores",
)


def parse_scale_line(line: str) -> dict[str, float]:
    assert line.startswith("SCALE "), f"the last line is not a SCALE line: {line!r}"
    values = dict(part.split("=", 1) for part in line.split()[1:])
    assert values.pop("store", None) == "sqlite", f"the store is not named, or is not the default: {line!r}"
    assert set(values) == set(FIELDS), f"fields {sorted(values)}, want {sorted(FIELDS)}"
    return {name: float(value) for name, value in values.items()}


def test_scale_bench_small() -> None:
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", MARKER: token}
    process = subprocess.Popen(
        [sys.executable, "bench/scale.py", "--hosts", str(HOSTS), "--slots", str(SLOTS)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, output
    assert not processes_with_env(f"{MARKER}={token}"), "the benchmark left processes behind"
    (simulators,) = [line for line in output.splitlines() if line.startswith("simulators: ")]
    counters = dict(part.split("=") for part in simulators.split(";")[0].removeprefix("simulators: ").split(", "))
    workers = HOSTS * SLOTS
    # Every rank of round 1, of the round after the drain and of the round after the lost host was checked.
    assert int(counters["ranks_checked"]) == workers + (workers - SLOTS) + (workers - 2 * SLOTS), simulators
    assert counters["rank_mismatches"] == "0" and counters["events_missed"] == "0", simulators
    assert int(counters["entries_sent"]) <= 4 * HOSTS, f"more than a few entries per host and round: {simulators}"
    assert simulators.endswith("error replies: none"), simulators
    numbers = parse_scale_line(output.strip().splitlines()[-1])
    assert all(math.isfinite(value) for value in numbers.values()), numbers
    assert (numbers["hosts"], numbers["slots"]) == (HOSTS, SLOTS)
    for name in ("round_s", "fanout_p50_ms", "fanout_max_ms", "reset_s", "cpu_s"):
        assert numbers[name] > 0, f"{name} is not positive: {numbers}"
    assert numbers["fanout_p50_ms"] <= numbers["fanout_max_ms"], numbers
    assert numbers["round_s"] < BOUND_S and numbers["reset_s"] < BOUND_S, numbers
