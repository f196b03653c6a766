"""The agent's orphan reaper (slot_processes/forking.py `reap_orphans`): an exited child it does not know is reaped;
a known child's exit status is left to its owner, who reads the real code (a probe process SIGKILLed reads -9, not
the 0 `Popen.wait` makes of a status someone else took). Run in a process of its own: the reaper takes any child of
the process that calls it, and this test session's other children are not its to take."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, os, subprocess, sys, time
from elastic_control_plane.slot_processes.forking import reap_orphans

def zombie(pid):
    deadline = time.monotonic() + 30
    while open(f"/proc/{pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the child never exited"
        time.sleep(0.01)

owned = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
try:
    orphan = subprocess.Popen([sys.executable, "-c", "pass"])
    zombie(orphan.pid)
    first = reap_orphans({owned.pid})
    orphan_gone = not os.path.exists(f"/proc/{orphan.pid}")
finally:
    owned.kill()  # a failing check leaves no sleeper behind
zombie(owned.pid)
second = reap_orphans({owned.pid})
print(json.dumps({"first": first, "orphan_gone": orphan_gone, "second": second, "owned_code": owned.wait()}))
"""


def test_an_unknown_child_is_reaped_and_a_known_childs_code_is_left_to_its_owner() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(done.stdout)
    assert result == {"first": 1, "orphan_gone": True, "second": 0, "owned_code": -9}, result
