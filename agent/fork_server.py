"""The agent's side of its host's fork server (libworker/zygote.py): start it, ask it for workers, replace it.

`ForkServer.prepare(key_of(plan))` makes sure a zygote for the job is
running or starting when the agent learns of the job (a round, or the job a
joining host is told of): one per interpreter, preload list, job
environment and working directory (its `Key`; the preloads are imported
there), kept after the job for the next one. `fork(...)`
returns a `ForkedProcess` (what `subprocess.Popen` is to a spawned worker:
pid, poll, wait, stdout and stderr pipes) or None, and the caller spawns
instead: the job's command is not `python SCRIPT`/`python -m MODULE`, fork
servers are off (`--no-fork-server`, ELASTIC_FORK_SERVER=0), or the zygote
refused (one log line, once per key), failed or is still starting.

While a zygote starts, `starting()` says so: the agent holds process starts
back until it is ready (a fresh interpreter would import torch beside it),
at most `START_LIMIT` seconds. A zygote that dies is started again; after
`DEATHS_ALLOWED` deaths in a job the agent spawns for the rest of that job.
The agent is a child subreaper (PR_SET_CHILD_SUBREAPER) while fork servers
are on, so forked workers are its children; `reap_orphans` reaps whatever
else is re-parented to it (a worker's own children left behind).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Collection, Mapping
from typing import Any, NamedTuple

from bus.contract import JobPlan
from bus.lifetime import die_with_parent

START_LIMIT = 60.0
ANSWER_LIMIT = 5.0
DEATHS_ALLOWED = 3
PR_SET_CHILD_SUBREAPER = 36
ENV_SWITCH = "ELASTIC_FORK_SERVER"


class Key(NamedTuple):
    """What a zygote is started with: one zygote serves the jobs that agree on all of it."""

    python: str
    preload: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    cwd: str  # the job's working directory, where the preloads are imported from ("": the agent's)


def script_argv(command: list[str]) -> list[str] | None:
    """The arguments a warm interpreter runs for `python SCRIPT ARGS` or `python -m MODULE ARGS`; None for anything
    else (interpreter options, another program)."""
    if len(command) < 2 or not os.path.basename(command[0]).startswith("python"):
        return None
    if command[1] == "-m":
        return command[1:] if len(command) > 2 else None
    return command[1:] if not command[1].startswith("-") else None


def key_of(plan: JobPlan) -> Key | None:
    """The zygote a job's workers can be forked from; None when they cannot (not a Python script, torchrun mode,
    the job turned fork servers off, or its python is not found)."""
    if plan.mode != "horovod" or not plan.fork_server or script_argv(plan.command) is None:
        return None
    python = shutil.which(plan.command[0])
    if python is None:
        return None
    return Key(os.path.realpath(python), tuple(plan.preload), tuple(sorted(plan.env.items())), plan.cwd or "")


def enabled(environ: Mapping[str, str]) -> bool:
    return environ.get(ENV_SWITCH, "1") != "0"


class ForkedProcess:
    """A worker forked by the zygote and re-parented to this process: waited for as a child, like a Popen."""

    def __init__(self, pid: int, stdout: int, stderr: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout, self.stderr = os.fdopen(stdout, "rb"), os.fdopen(stderr, "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            self._wait(os.WNOHANG)
        return self.returncode

    def wait(self) -> int:
        while self.returncode is None:
            self._wait(0)
        return self.returncode

    def _wait(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:
            self.returncode = -signal.SIGKILL  # not ours to wait for (cannot happen once re-parented): gone
            return
        if pid == self.pid:
            self.returncode = os.waitstatus_to_exitcode(status)


class Zygote:
    """One zygote process and its end of the socket pair."""

    def __init__(self, key: Key, base_env: Mapping[str, str]) -> None:
        self.key = key
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = [key.python, "-m", "libworker.zygote", "--socket-fd", str(theirs.fileno())]
        if key.preload:
            command += ["--preload", ",".join(key.preload)]
        try:
            self.process = subprocess.Popen(command, env={**base_env, **dict(key.env), "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, cwd=key.cwd if os.path.isdir(key.cwd) else None,
                                            pass_fds=(theirs.fileno(),), preexec_fn=die_with_parent())
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
        hello = _parse(message)
        if hello.get("ready"):
            self.ready = True
        else:
            self.refused = str(hello.get("refused") or f"it said {message[:200]!r} instead of being ready")
        return self.ready

    def fork(self, order: dict[str, Any], fds: list[int]) -> int:
        """The forked worker's pid; OSError/ValueError when the zygote cannot serve it."""
        self.sock.settimeout(ANSWER_LIMIT)
        socket.send_fds(self.sock, [json.dumps(order).encode()], fds)
        answer = _parse(self.sock.recv(65536))
        if not isinstance(answer.get("pid"), int):
            raise ValueError(str(answer.get("error") or "the fork server closed its socket"))
        return answer["pid"]

    def stop(self) -> None:
        self.sock.close()
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _parse(message: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(message) if message else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


class ForkServer:
    """The agent's zygote (at most one at a time), or the reasons it spawns instead."""

    def __init__(self, on: bool, log: Any) -> None:
        self.on, self.log = on, log
        self.zygote: Zygote | None = None
        self.refused: set[Key] = set()
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
            self.zygote = Zygote(key, os.environ)
        except OSError as exc:
            self._refuse(key, f"cannot start it: {exc}")
            return
        self.log.info("fork_server_starting", pid=self.zygote.process.pid, python=key.python, preload=list(key.preload))

    def new_job(self) -> None:
        self.deaths = 0

    def starting(self, key: Key | None) -> bool:
        """The zygote for `key` is still importing (process starts wait for it, up to START_LIMIT)."""
        zygote = self._serving(key, ready_only=False)
        if zygote is None or zygote.check_ready():
            return False
        if time.monotonic() - zygote.started > START_LIMIT:
            self._refuse(zygote.key, f"not ready after {START_LIMIT:.0f} s")
            return False
        return True

    def fork(self, key: Key | None, command: list[str], env: Mapping[str, str], cwd: str | None) -> ForkedProcess | None:
        """A worker forked from the zygote for `key` that runs `command` (`python SCRIPT ARGS` or `python -m MODULE
        ARGS`) with this environment and cwd; None: spawn it instead."""
        zygote, argv = self._serving(key, ready_only=True), script_argv(command)
        if zygote is None or argv is None:
            return None
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        order = {"argv": argv, "cmdline": command, "env": dict(env), "cwd": cwd if cwd and os.path.isdir(cwd) else os.getcwd(), "agent_pid": os.getpid(),
                 "umask": _umask(), "rlimits": {name: resource.getrlimit(getattr(resource, name)) for name in _RLIMITS}}
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
        """After SIGCHLD: a zygote that refused (an import failed, a thread or CUDA in it) is not started again for its
        key; one that died (a signal, a crash; while importing or serving) is started again."""
        zygote = self.zygote
        if zygote is None or zygote.process.poll() is None:
            return
        zygote.check_ready()
        if zygote.refused is not None:
            self._refuse(zygote.key, zygote.refused)
            return
        self.log.warning("fork_server_died", pid=zygote.process.pid, exit_code=zygote.process.returncode, was_ready=zygote.ready)
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
            self.log.warning("fork_server_given_up", deaths=self.deaths, detail="workers are spawned for the rest of this job")
            return
        self.prepare(key)

    def _refuse(self, key: Key, reason: str) -> None:
        self.refused.add(key)
        self.close()
        self.log.warning("fork_server_unavailable", reason=reason, detail="workers are spawned instead")


_RLIMITS = [name for name in ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_FSIZE", "RLIMIT_NPROC",
                              "RLIMIT_MEMLOCK") if hasattr(resource, name)]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stdin() -> int:
    """This process's stdin for its workers (/dev/null when it has none)."""
    try:
        os.fstat(0)
        return 0
    except OSError:
        return os.open(os.devnull, os.O_RDONLY)
