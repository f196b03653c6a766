"""Worker processes of one host: spawn (dying with the agent), signal, reap.

A worker's stdout and stderr are pipes the agent reads (agent/output.py).
Each worker runs in its own session so a signal reaches its whole process
tree, and has PR_SET_PDEATHSIG set so it is killed if the agent dies, even by
SIGKILL: an agent never leaves orphans.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from dataclasses import dataclass

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class Worker:
    local_rank: int
    process: subprocess.Popen[bytes]
    stop_requested: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


def spawn(local_rank: int, command: list[str], env: dict[str, str], cwd: str | None) -> Worker:
    process = subprocess.Popen(
        command,
        env=env,
        cwd=cwd if cwd and os.path.isdir(cwd) else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    return Worker(local_rank, process)


def reap(workers: dict[int, Worker]) -> list[tuple[Worker, int]]:
    """Remove and return the workers that have exited, with their exit codes (negative: killed by signal)."""
    exited = []
    for local_rank, worker in list(workers.items()):
        code = worker.process.poll()
        if code is not None:
            del workers[local_rank]
            exited.append((worker, code))
    return exited
