"""A round that failed to form leaves nothing behind that keeps the next one from forming.

A peer killed while a round's process group connects makes the survivors'
formation time out. The round after, they form a group with a replacement, a
fresh process: both must name the group alike. (torch names it by a
process-wide count of groups made, which only the destruction of a group that
formed resets: before the fix a survivor looked for group "1" while the
replacement wrote group "0", and every later round of the job timed out
forming; found by test_clean_exit under load.)
"""

from __future__ import annotations

import os
import subprocess
import sys

from testing.harness import REPO, free_ports


def test_a_survivor_of_a_round_that_failed_to_form_forms_the_next_with_a_fresh_replacement() -> None:
    port = free_ports(1)[0]
    worker = [sys.executable, "tests/workers/form_round.py", str(port)]
    run = {"cwd": REPO, "env": {**os.environ, "PYTHONPATH": str(REPO)}, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    survivor = subprocess.Popen([*worker, "0", "2", "1"], **run)
    replacement = subprocess.Popen([*worker, "1", "2"], **run)
    try:
        outputs = [process.communicate(timeout=60)[0] for process in (survivor, replacement)]
    finally:
        for process in (survivor, replacement):
            process.kill()
            process.wait()
    assert [process.returncode for process in (survivor, replacement)] == [0, 0], outputs
    assert all("allreduce gave 3" in output for output in outputs), outputs
