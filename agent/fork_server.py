"""The agent's side of its host's fork server (slot_processes/zygote.py): start it, ask it for workers, replace it, say
why it does not serve.

A zygote is started with the job's interpreter exactly as the job names it (`python` found on the workers' PATH,
a virtualenv's `bin/python`, a conda env's, a pyenv shim). At start the agent prepares one for its own interpreter
(`own_key`), so an agent that waits for a job has torch imported before the job arrives; `prepare(key)` makes sure
the job's zygote is running or starting when the agent learns of the job. Which zygote serves which job (its `Key`)
is chosen in agent/fork_choice.py; a zygote is kept after its job for the next one.

`fork(...)` returns a `ForkedProcess` (what `subprocess.Popen` is to a spawned worker: pid, poll, wait, stdout and
stderr pipes) or None, and the caller spawns instead. A Horovod-mode job's worker is the command itself; a torchrun-mode
job's is the slot's supervisor around it (`python -m elastic_control_plane.slot_processes.torchrun_slot -- CMD`), forked
from the same zygote, which then forks each round's command from a fork of its own (slot_processes/command_seed.py).

Why a host spawns instead is always said (`availability`): the command is not `python SCRIPT`/`python -m MODULE`,
fork servers are off, the zygote refused (an import failed or left a thread or CUDA behind) or exited while it
imported (the last line of its stderr says why: `ModuleNotFoundError: No module named 'torch'`), or it died
`DEATHS_ALLOWED` times in the job. A zygote killed by a signal is started again. While a zygote starts,
`starting()` says so: the agent holds process starts back until it is ready (a fresh interpreter would import torch
beside it), at most `zygote_start_limit` seconds (agent/intervals.py).

The agent is a child subreaper (PR_SET_CHILD_SUBREAPER) while fork servers are on, so forked workers are its
children; `reap_orphans` reaps whatever else is re-parented to it (a worker's own children left behind).
"""

from __future__ import annotations

import ctypes
import os
import resource
import socket
import subprocess
import tempfile
import time
from collections.abc import Collection, Mapping
from typing import Any

from elastic_control_plane.agent.fork_choice import Key
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.workers import inheritable
from elastic_control_plane.bus.lifetime import die_with_parent
from elastic_control_plane.slot_processes.forking import (
    PR_SET_CHILD_SUBREAPER,
    ForkedProcess,
    current_umask,
    parse_answer,
    send_order,
)

DEATHS_ALLOWED = 3
ENV_SWITCH = "ELASTIC_FORK_SERVER"
SPAWN_COST = "workers start as fresh interpreters (seconds per restart)"


def enabled(environ: Mapping[str, str]) -> bool:
    return environ.get(ENV_SWITCH, "1") != "0"


class Zygote:
    """One zygote process and its end of the socket pair; its stderr goes to a file, read when it exits unready."""

    def __init__(self, key: Key, base_env: Mapping[str, str]) -> None:
        self.key = key
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [key.python, "-m", "elastic_control_plane.slot_processes.zygote", "--socket-fd", str(theirs.fileno())]
        if key.preload:
            command += ["--preload", ",".join(key.preload)]
        self.stderr = tempfile.TemporaryFile()
        try:
            self.process = subprocess.Popen(
                command,
                env={**base_env, **dict(key.env), "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self.stderr,
                cwd=key.cwd if os.path.isdir(key.cwd) else None,
                pass_fds=(theirs.fileno(),),
                preexec_fn=die_with_parent(),
            )
        except OSError:
            self.sock.close()
            self.stderr.close()
            raise
        finally:
            theirs.close()
        self.started = time.monotonic()
        self.ready = False
        self.refused: str | None = None

    def check_ready(self) -> bool:
        """Read the zygote's first word if it has come: True once it serves."""
        if self.ready or self.refused is not None:
            return self.ready
        try:
            message = self.sock.recv(65536, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if not message:
            return False  # it exited without a word: it died (check() tells)
        hello = parse_answer(message)
        if hello.get("ready"):
            self.ready = True
        else:
            self.refused = str(hello.get("refused") or f"it said {message[:200]!r} instead of being ready")
        return self.ready

    def exit_reason(self) -> str | None:
        """Why a zygote that exited by itself before it was ready did (the last line of its stderr: the error that
        stopped its imports); None when it was killed by a signal or had served (it may be started again)."""
        code = self.process.returncode
        if self.ready or code is None or code <= 0:
            return None
        self.stderr.seek(0)
        lines = [
            line.strip() for line in self.stderr.read()[-4096:].decode(errors="replace").splitlines() if line.strip()
        ]
        return f"the fork server exited with code {code}" + (f": {lines[-1][:300]}" if lines else "")

    def fork(self, order: dict[str, Any], fds: list[int]) -> int:
        """The forked worker's pid; OSError/ValueError when the zygote cannot serve it."""
        return send_order(self.sock, order, fds)

    def stop(self) -> None:
        self.sock.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.stderr.close()


class ForkServer:
    """The agent's zygote (at most one at a time), or the reasons it spawns instead."""

    def __init__(self, on: bool, log: Any) -> None:
        self.on, self.log = on, log
        self.zygote: Zygote | None = None
        self.refused: dict[Key, str] = {}
        self.deaths = 0
        self.stdin = _stdin()
        if on:
            ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)

    def prepare(self, key: Key | None) -> None:
        """Have a zygote for `key` running or starting (the previous one, for another key, is stopped)."""
        if not self.on or key is None or key in self.refused or self.deaths >= DEATHS_ALLOWED:
            return
        if self.zygote is not None and self.zygote.key == key and self.zygote.process.poll() is None:
            return
        self.close()
        try:
            self.zygote = Zygote(key, inheritable(os.environ))
        except OSError as exc:
            self._refuse(key, f"cannot start it: {exc}")
            return
        self.log.info("fork_server_starting", pid=self.zygote.process.pid, python=key.python, preload=list(key.preload))

    def new_job(self) -> None:
        self.deaths = 0

    def availability(self, key: Key | None, why_not: str) -> dict[str, str]:
        """This host's fork server for a job whose workers would be forked from `key` (None: they cannot be, for
        `why_not`): {"state": "ready" | "starting" | "unavailable" | "off", "reason": why it does not serve}."""
        if not self.on:
            return {"state": "off", "reason": "the agent runs with --no-fork-server or ELASTIC_FORK_SERVER=0"}
        if key is None:
            return {"state": "unavailable", "reason": why_not}
        if key in self.refused:
            return {"state": "unavailable", "reason": self.refused[key]}
        if self.deaths >= DEATHS_ALLOWED:
            return {"state": "unavailable", "reason": f"the fork server died {self.deaths} times in this job"}
        zygote = self._serving(key, ready_only=False)
        if zygote is not None and zygote.check_ready():
            return {"state": "ready", "reason": ""}
        return {"state": "starting", "reason": ""}

    def starting(self, key: Key | None) -> bool:
        """The zygote for `key` is still importing (process starts wait for it, up to `zygote_start_limit`)."""
        zygote = self._serving(key, ready_only=False)
        if zygote is None or zygote.check_ready():
            return False
        if time.monotonic() - zygote.started > INTERVALS.zygote_start_limit:
            self._refuse(zygote.key, f"not ready after {INTERVALS.zygote_start_limit:.0f} s")
            return False
        return True

    def fork(
        self, key: Key | None, command: list[str], env: Mapping[str, str], cwd: str | None
    ) -> ForkedProcess | None:
        """A worker forked from the zygote for `key` that runs `command` (`python SCRIPT ARGS` or `python -m MODULE
        ARGS`, shown as its command line) with this environment and cwd; None: spawn it instead."""
        zygote = self._serving(key, ready_only=True)
        if zygote is None:
            return None
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        order = {
            "argv": command[1:],
            "cmdline": command,
            "env": dict(env),
            "cwd": cwd if cwd and os.path.isdir(cwd) else os.getcwd(),
            "agent_pid": os.getpid(),
            "umask": current_umask(),
            "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in _RLIMITS},
        }
        try:
            pid = zygote.fork(order, [self.stdin, out_write, err_write])
        except (OSError, ValueError) as exc:
            for fd in (out_read, err_read):
                os.close(fd)
            self.log.warning("fork_server_failed", reason=str(exc) or type(exc).__name__)
            self._zygote_lost()
            return None
        finally:
            os.close(out_write)
            os.close(err_write)
        return ForkedProcess(pid, out_read, err_read)

    def check(self) -> None:
        """After SIGCHLD: a zygote that refused (an import failed, a thread or CUDA in it) or exited by itself while
        it imported is not started again for its key; one killed by a signal (while importing or serving) or that
        died after it served is started again."""
        zygote = self.zygote
        if zygote is None or zygote.process.poll() is None:
            return
        zygote.check_ready()
        reason = zygote.refused or zygote.exit_reason()
        if reason is not None:
            self._refuse(zygote.key, reason)
            return
        self.log.warning(
            "fork_server_died", pid=zygote.process.pid, exit_code=zygote.process.returncode, was_ready=zygote.ready
        )
        self._zygote_lost()

    def pids(self) -> Collection[int]:
        return () if self.zygote is None else (self.zygote.process.pid,)

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.stop()
            self.zygote = None

    def _serving(self, key: Key | None, ready_only: bool) -> Zygote | None:
        zygote = self.zygote
        if key is None or zygote is None or zygote.key != key or zygote.process.poll() is not None:
            return None
        if ready_only and not zygote.check_ready():
            return None
        return zygote

    def _zygote_lost(self) -> None:
        assert self.zygote is not None
        key = self.zygote.key
        self.close()
        self.deaths += 1
        if self.deaths >= DEATHS_ALLOWED:
            self.log.warning(
                "fork_server_given_up", deaths=self.deaths, detail="workers are spawned for the rest of this job"
            )
            return
        self.prepare(key)

    def _refuse(self, key: Key, reason: str) -> None:
        self.refused[key] = reason
        self.close()
        self.log.warning(
            "fork_server_unavailable", python=key.python, reason=reason, detail="workers are spawned instead"
        )


_RLIMITS = [
    name
    for name in (
        "RLIMIT_NOFILE",
        "RLIMIT_CORE",
        "RLIMIT_STACK",
        "RLIMIT_AS",
        "RLIMIT_DATA",
        "RLIMIT_FSIZE",
        "RLIMIT_NPROC",
        "RLIMIT_MEMLOCK",
    )
    if hasattr(resource, name)
]


def _stdin() -> int:
    """This process's stdin for its workers (/dev/null when it has none)."""
    try:
        os.fstat(0)
        return 0
    except OSError:
        return os.open(os.devnull, os.O_RDONLY)
