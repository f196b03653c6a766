"""A real 3-node Slurm on this machine for the tests and bench/slurm.py: scripts/slurm.sh starts it (installing
Debian's slurmctld, slurmd and munge when missing) and stops it; `SlurmCluster` submits jobs the way a user does
(`elasticctl slurm` in the user's own directory), reads their output and their workers' event logs, and puts the
cluster back between tests: every job cancelled, every node resumed and idle.

Starting needs root (it starts slurmctld, slurmd and munged): a test that cannot start it fails, it does not skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from testing.harness import read_events, wait_for

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "slurm.sh"
NODES = ("node1", "node2", "node3")
WORKER_FILES = (
    REPO / "tests" / "workers" / "counter.py",
    REPO / "examples" / "train_elastic.py",
    REPO / "examples" / "train.py",
)


def slurm(*argv: str) -> str:
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, timeout=30).stdout


class SlurmCluster:
    """Jobs on the running cluster, each submitted from `user_dir` (the user's own directory, with the counter job's
    files copied into it)."""

    def __init__(self, user_dir: Path) -> None:
        self.user_dir = user_dir
        user_dir.mkdir(parents=True, exist_ok=True)
        for path in WORKER_FILES:
            shutil.copy(path, user_dir / path.name)

    def submit(self, *args: str, env: dict[str, str] | None = None) -> str:
        """`elasticctl slurm ARGS` in the user's directory; the job id."""
        done = subprocess.run(
            [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "slurm", *args],
            cwd=self.user_dir,
            capture_output=True,
            text=True,
            env={**os.environ, **(env or {})},
            timeout=60,
        )
        assert done.returncode == 0, f"elasticctl slurm failed ({done.returncode}): {done.stderr}"
        return done.stdout.split()[3]

    def output(self, job: str) -> str:
        path = self.user_dir / f"elastic-{job}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, log_dir: str) -> list[dict[str, Any]]:
        return read_events(self.user_dir / log_dir)

    def job_state(self, job: str) -> str:
        """RUNNING, PENDING, COMPLETED, FAILED ... (scontrol show job)."""
        for word in slurm("scontrol", "show", "job", job).split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def wait_ended(self, job: str, timeout: float) -> str:
        return wait_for(
            lambda: (state := self.job_state(job)) in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT") and state,
            timeout,
            f"job {job} to end (output: {self.output(job)[-3000:]})",
            interval=0.3,
        )

    def exit_code(self, job: str) -> str:
        for word in slurm("scontrol", "show", "job", job).split():
            if word.startswith("ExitCode="):
                return word.split("=", 1)[1]
        return "?"

    def reset(self) -> None:
        """Every job cancelled, every node resumed, running and idle (the next test starts from a clean cluster)."""
        jobs = slurm("squeue", "-h", "-o", "%A").split()
        if jobs:
            subprocess.run(["scancel", *jobs], check=False, capture_output=True)
        for node in NODES:
            pid_file = Path(f"/run/slurmd-{node}.pid")
            if not (pid_file.exists() and _alive(int(pid_file.read_text() or 0))):
                subprocess.run(["/usr/sbin/slurmd", "-N", node], check=True)
        wait_for(lambda: not slurm("squeue", "-h", "-o", "%A").split(), 60, "every job to end", interval=0.2)
        remove_orphan_snapshots()
        for node in NODES:
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False, capture_output=True)
        wait_for(
            lambda: sorted(slurm("sinfo", "-h", "-N", "-t", "idle", "-o", "%N").split()) == list(NODES),
            60,
            "every node to be idle",
            interval=0.2,
        )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return pid > 0
    except OSError:
        return False


def remove_orphan_snapshots() -> None:
    """The snapshot buffers of agents that were killed (a node lost): what the next agent started on the node would
    remove (agent/snapshots.py)."""
    directory = Path(os.environ.get("ELASTIC_SHM_DIR", "/dev/shm"))
    for path in directory.glob("elastic-snapshot-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)


def agent_pid(node: str) -> int | None:
    """The pid of the agent Slurm started on `node` (every node is this machine: found by its command line)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"elastic_control_plane.agent.main" in argv and node.encode() in argv:
            return int(proc.name)
    return None


def kill_node(node: str) -> None:
    """What a node's power loss does to the job here: its slurmd and its agent SIGKILLed (the workers die with their
    agent)."""
    os.kill(int(Path(f"/run/slurmd-{node}.pid").read_text()), signal.SIGKILL)
    pid = agent_pid(node)
    if pid is not None:
        os.kill(pid, signal.SIGKILL)


@contextmanager
def running_slurm(conf: Path | None = None) -> Iterator[None]:
    """Slurm started for the block (with `conf`, else testing/slurm/slurm.conf) and stopped after it, whatever happens
    in it."""
    if os.geteuid() != 0:
        raise RuntimeError("the Slurm tests start slurmctld, slurmd and munged: run them as root (CI does)")
    started = time.monotonic()
    env = {**os.environ, **({"ELASTIC_SLURM_CONF": str(conf)} if conf is not None else {})}
    subprocess.run([str(SCRIPT), "start"], check=True, timeout=600, env=env)
    print(f"slurm started in {time.monotonic() - started:.1f}s", file=sys.stderr)
    try:
        yield
    finally:
        subprocess.run([str(SCRIPT), "stop"], check=False, timeout=120, env=env)
