"""Leaving a round never waits for a collective a live peer abandoned.

A survivor of a failed collective may leave another of the round's works
pending (a gradient bucket launched ahead of the one that failed), waiting for
data from another survivor that left it too. gloo's group destructor waits for
its works, so two such survivors each blocked the other's release for the whole
collective timeout (a 20 s stall about once in 70 crashes; issue 23's soak,
then CI). Now the group is held aside until its works end, the next round
forms at once, and the old group is dropped once its works have ended.
"""

from __future__ import annotations

import os
import subprocess
import sys

from testing.harness import REPO, free_ports


def test_survivors_leave_a_round_with_a_pending_collective_at_once_and_drop_its_group_once_it_ends() -> None:
    port = free_ports(1)[0]
    run = {
        "cwd": REPO,
        "env": {**os.environ, "PYTHONPATH": str(REPO)},
        "stdout": subprocess.PIPE,
        "stderr": subprocess.STDOUT,
        "text": True,
    }
    ranks = [
        subprocess.Popen([sys.executable, "tests/workers/leave_with_pending_work.py", str(port), str(rank)], **run)
        for rank in range(3)
    ]
    try:
        outputs = [process.communicate(timeout=90)[0] for process in ranks]
    finally:
        for process in ranks:
            process.kill()
            process.wait()
    assert [process.returncode for process in ranks] == [0, 0, 0], outputs
    for output in outputs[:2]:
        released = next(line for line in output.splitlines() if line.startswith("released after"))
        seconds = float(released.split()[2].rstrip("s,"))
        assert seconds < 2.0 and released.endswith("holding 1"), output
        assert "allreduce gave 3" in output, output
        assert "still holding 0" in output, output
