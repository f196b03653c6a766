"""The scale benchmark at a small size (64 hosts x 2 slots, simulated agents against the real services): it runs
to the end, its last line is a complete SCALE line with sane numbers, and it leaves no process behind."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import uuid

from testing.harness import REPO, processes_with_env

HOSTS, SLOTS = 64, 2
BOUND_S = 30.0  # round_s and reset_s take well under a second here; anything near this is a regression
MARKER = "ELASTIC_SCALE_TEST"  # in the environment of every process the benchmark starts: found if one is left
FIELDS = ("hosts", "slots", "round_s", "fanout_p50_ms", "fanout_max_ms", "reset_s", "cpu_s")


def parse_scale_line(line: str) -> dict[str, float]:
    assert line.startswith("SCALE "), f"the last line is not a SCALE line: {line!r}"
    values = dict(part.split("=", 1) for part in line.split()[1:])
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
    numbers = parse_scale_line(output.strip().splitlines()[-1])
    assert all(math.isfinite(value) for value in numbers.values()), numbers
    assert (numbers["hosts"], numbers["slots"]) == (HOSTS, SLOTS)
    for name in ("round_s", "fanout_p50_ms", "fanout_max_ms", "reset_s", "cpu_s"):
        assert numbers[name] > 0, f"{name} is not positive: {numbers}"
    assert numbers["fanout_p50_ms"] <= numbers["fanout_max_ms"], numbers
    assert numbers["round_s"] < BOUND_S and numbers["reset_s"] < BOUND_S, numbers
