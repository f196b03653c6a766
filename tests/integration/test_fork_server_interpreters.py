"""The fork server under the interpreter a job names (issue 31), with real zygote processes: the test's own
interpreter (a virtualenv's python in CI) serves; a virtualenv without the job's packages and one deleted under the
agent are unavailable at once, each with one line that says why, and are never started again in a loop."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from testing.harness import REPO

# In a process of its own: a ForkServer makes its process a child subreaper, which this test session must not be.
PREPARE = """
import json, sys, time
from elastic_control_plane.agent.fork_choice import Key, interpreter_identity
from elastic_control_plane.agent.fork_server import ForkServer

class Log:
    def __init__(self):
        self.events = []
    def info(self, event, **fields):
        self.events.append({"event": event, **fields})
    warning = info

log = Log()
server = ForkServer(True, log)
python = sys.argv[1]
key = Key(interpreter_identity(python), (), (), "", python)
server.prepare(key)
deadline = time.monotonic() + 90
while server.availability(key, "")["state"] == "starting" and time.monotonic() < deadline:
    time.sleep(0.02)
    server.check()
availability = server.availability(key, "")
server.prepare(key)  # a key given up on is not started again
events, reasons = [e["event"] for e in log.events], [e.get("reason") for e in log.events]
print(json.dumps({"availability": availability, "events": events, "reasons": reasons, "running": bool(server.zygote)}))
server.close()
"""


def prepare(python: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", PREPARE, python], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def bare_virtualenv(directory: Path) -> str:
    """A virtualenv with this project (its editable install's finder, as `pip install -e` made it) and nothing else:
    no torch."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(directory)], check=True, timeout=120)
    ours = Path(sysconfig.get_paths()["purelib"])
    finder = sorted(ours.glob("__editable__*elastic_control_plane*"))
    assert finder, f"no editable install of the project in {ours} (scripts/install.sh makes one)"
    (theirs,) = directory.glob("lib/python*/site-packages")
    for path in finder:
        shutil.copy(path, theirs / path.name)
    return str(directory / "bin" / "python")


def test_the_interpreter_running_the_tests_serves_as_named() -> None:
    found = prepare(sys.executable)
    assert found["availability"] == {"state": "ready", "reason": ""}, found
    assert found["events"] == ["fork_server_starting"] and found["running"], found


def test_a_virtualenv_without_torch_is_unavailable_once_with_the_import_error(tmp_path: Path) -> None:
    found = prepare(bare_virtualenv(tmp_path / "bare"))
    assert found["availability"]["state"] == "unavailable", found
    reason = found["availability"]["reason"]
    assert reason == "torch: ModuleNotFoundError: No module named 'torch'", reason  # the zygote refused its preload
    assert found["events"] == ["fork_server_starting", "fork_server_unavailable"], (
        "not started again: it would fail the same way"
    )
    assert not found["running"]


def test_a_virtualenv_deleted_under_the_agent_is_one_clear_error(tmp_path: Path) -> None:
    python = bare_virtualenv(tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")
    found = prepare(python)
    assert found["availability"]["state"] == "unavailable", found
    assert found["availability"]["reason"].startswith("cannot start it: [Errno 2] No such file or directory"), found
    assert found["events"] == ["fork_server_unavailable"] and not found["running"], found
