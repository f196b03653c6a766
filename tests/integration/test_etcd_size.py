"""etcd's size plateaus over hundreds of resets (bench/etcd_size.py, short): a real 3-member etcd with an 8 MiB quota,
the real services on it, 16 simulated hosts x 2 slots driven through 360 resets (a host drained, then undrained).

The quota is small enough that history left uncompacted fills it: a reset of 16 x 2 writes 10 to 25 KB (more while the
job's kept decisions fill up to the registry's HISTORY_KEPT, 100 of them), and when only the revision count (every
10,000) and etcd's periodic 10-minute compaction bounded the history, the database grew about 25 KB a reset and this
very run reached the quota between resets 240 and 300: the registry found etcd full (`etcd_space_exceeded`, nospace=1)
and 3.9 MB after the warmup became 8.1 MB. The warmup is 120 resets, past the 100 decisions; live data still grows
slowly after it, as the notifier's kept history fills towards its 4,096 events (about 350 bytes each in etcd here),
which the factor 2 leaves room for: with the byte compaction this run ends at about 1.2x. Asserted: no replica ever
found etcd full, no NOSPACE alarm is raised, no compaction failed, the database stays under half the quota and ends at
most twice its size after the warmup; the bench leaves no process and no temporary directory behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from testing.harness import REPO, processes_with_env

HOSTS, SLOTS, RESETS, WARMUP, QUOTA_MIB = 16, 2, 360, 120, 8
TIMEOUT_S = 400  # about 2 minutes on a loaded 2-core machine; a hang fails here rather than stalling CI
MARKER = "ELASTIC_ETCD_SIZE_TEST"  # in the environment of every process the bench starts: found if one is left


def parse_line(line: str) -> dict[str, float]:
    assert line.startswith("ETCD_SIZE "), f"the last line is not an ETCD_SIZE line: {line!r}"
    return {name: float(value) for name, value in (part.split("=", 1) for part in line.split()[1:])}


def test_etcd_size_plateaus_without_nospace(tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp_path), MARKER: token}
    command = [sys.executable, "bench/etcd_size.py", "--hosts", str(HOSTS), "--slots", str(SLOTS)]
    command += ["--resets", str(RESETS), "--warmup", str(WARMUP), "--every", "60", "--quota-mib", str(QUOTA_MIB)]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for pid in processes_with_env(f"{MARKER}={token}"):
            os.kill(pid, signal.SIGKILL)
    assert process.returncode == 0, output
    assert not processes_with_env(f"{MARKER}={token}"), "the bench left processes behind"
    assert not list(tmp_path.glob("elastic-etcd-size-*")), "the bench left its temporary directory behind"
    numbers = parse_line(output.strip().splitlines()[-1])
    assert numbers["resets"] == RESETS and numbers["warmup"] == WARMUP, numbers
    assert numbers["nospace"] == 0 and numbers["alarms"] == 0, f"etcd was found full: {output}"
    assert numbers["not_compacted"] == 0, output
    assert numbers["bytes_per_reset"] > 0 and numbers["first_db_bytes"] > 0, numbers
    assert numbers["max_db_bytes"] < QUOTA_MIB * 2**20 / 2, numbers
    assert numbers["growth"] <= 2.0, f"etcd's database did not plateau: {output}"
