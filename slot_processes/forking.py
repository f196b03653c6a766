"""The fork order protocol: one order from a parent, one process forked by a warm interpreter, re-parented to it.

Two kinds of warm interpreters serve it: the host's fork server (slot_processes/zygote.py, ordered by its agent,
agent/fork_server.py) and a torchrun-mode supervisor's seed (slot_processes/command_seed.py, ordered by its supervisor).
Both ends are here: `send_order` is the parent's, `serve` the warm interpreter's.

An order is one JSON message on a SOCK_SEQPACKET socket (the script's `argv`, the command line to show, its `env`,
`cwd`, the parent's rlimits and umask, the parent's pid as `agent_pid`) carrying three fds: the new process's stdin,
stdout and stderr. For each order the server forks twice: the intermediate child forks the worker and exits, so the
worker is re-parented to the parent that ordered it (a child subreaper, PR_SET_CHILD_SUBREAPER), which waits for it as
a `ForkedProcess` and reaps whatever else is re-parented to it (`reap_orphans`). Before the server answers
`{"pid": PID}` the worker has its own session and has been re-parented; it then sets itself up and runs its script
(slot_processes/warm_start.py). An order the server cannot serve (malformed, or forking is unsafe: `fork_hazards`) is
answered `{"error": REASON}`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Collection
from typing import IO, Any, Protocol

ORDER_BYTES, ORDER_FDS = 1 << 20, 3
ANSWER_LIMIT = 5.0
PR_SET_CHILD_SUBREAPER = 36


class WorkerProcess(Protocol):
    """A worker's process as its parent waits for it: spawned (subprocess.Popen) or forked (`ForkedProcess`)."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self) -> int: ...


class ForkedProcess:
    """A worker forked by a warm interpreter and re-parented to this process: waited for as a child, like a Popen
    (with the read ends of its stdout and stderr pipes, where it has them)."""

    def __init__(self, pid: int, stdout: int | None = None, stderr: int | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self.stdout = None if stdout is None else os.fdopen(stdout, "rb")
        self.stderr = None if stderr is None else os.fdopen(stderr, "rb")

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


def send_order(sock: socket.socket, order: dict[str, Any], fds: list[int]) -> int:
    """Send one order (with the worker's stdin, stdout and stderr as fds) to a zygote or a torchrun supervisor's
    seed; the forked process's pid, or OSError/ValueError when it cannot serve."""
    sock.settimeout(ANSWER_LIMIT)
    socket.send_fds(sock, [json.dumps(order).encode()], fds)
    answer = parse_answer(sock.recv(65536))
    if not isinstance(answer.get("pid"), int):
        raise ValueError(str(answer.get("error") or "it closed its socket"))
    return answer["pid"]


def parse_answer(message: bytes) -> dict[str, Any]:
    """A warm interpreter's JSON word ({} when it is not a JSON object)."""
    try:
        parsed = json.loads(message) if message else {}
    except ValueError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def reap_orphans(known: Collection[int]) -> int:
    """Reap the exited children that are none of `known` (a worker's own children re-parented to this subreaper);
    the count reaped. A known child's exit is left to its owner's poll."""
    reaped = 0
    while True:
        try:
            exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if exited is None or exited.si_pid in known:
            return reaped
        os.waitpid(exited.si_pid, 0)
        reaped += 1


def native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def fork_hazards(allowed_threads: int) -> list[str]:
    """Why forking this process now would be unsafe: threads beyond `allowed_threads` (a lock held across fork stays
    held in the child), or CUDA initialised (a forked child cannot use it)."""
    hazards = []
    if threading.active_count() > 1:
        names = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
        hazards.append(f"Python threads running: {', '.join(names)}")
    elif native_threads() > allowed_threads:
        hazards.append(f"{native_threads() - allowed_threads} native thread(s) started by the preloaded modules")
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        hazards.append("CUDA is initialised")
    return hazards


def serve(sock: socket.socket, allowed_threads: int) -> tuple[dict[str, Any], list[int]]:
    """Answer orders until the parent closes its end (then exit 0); returns only in a forked worker, with its order."""
    while True:
        message, fds, _, _ = socket.recv_fds(sock, ORDER_BYTES, ORDER_FDS)
        if not message:
            sys.exit(0)
        try:
            order = json.loads(message)
            if len(fds) != ORDER_FDS:
                raise ValueError(f"an order carries {ORDER_FDS} fds, this one {len(fds)}")
        except ValueError as exc:
            _close(fds)
            sock.send(json.dumps({"error": f"bad order: {exc}"}).encode())
            continue
        hazards = fork_hazards(allowed_threads)
        if hazards:
            _close(fds)
            sock.send(json.dumps({"error": "; ".join(hazards)}).encode())
            continue
        pid = _fork_worker(order)
        if pid == 0:
            return order, fds
        _close(fds)
        sock.send(json.dumps({"pid": pid} if pid > 0 else {"error": "fork failed: the worker did not start"}).encode())


def _fork_worker(order: dict[str, Any]) -> int:
    """Fork the order's worker through an intermediate child that exits at once, so the worker's parent becomes the
    one that ordered it; the worker's pid here (once it has its own session and its new parent), 0 in the worker,
    -1 on failure."""
    pid_read, pid_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        intermediate = os.fork()
    except OSError:
        _close([pid_read, pid_write])
        return -1
    if intermediate == 0:
        try:
            worker = os.fork()
        except OSError:
            os._exit(1)
        if worker == 0:
            os.close(pid_read)
            os.setsid()
            os.write(pid_write, str(os.getpid()).encode())
            os.close(pid_write)
            return 0
        os._exit(0)
    os.close(pid_write)
    with os.fdopen(pid_read, "rb") as pipe:
        written = pipe.read()
    os.waitpid(intermediate, 0)
    return int(written) if written.isdigit() else -1


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
