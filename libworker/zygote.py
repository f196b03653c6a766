"""The host's fork server (a zygote): torch imported once, every worker a `fork()` of it that runs the script.

`python -m libworker.zygote --socket-fd N [--preload MODULE,...]` is started by
its agent (agent/fork_server.py) on one end of a SOCK_SEQPACKET socket pair.
It imports what a worker would (torch, DDP, numpy, libworker: `PRELOADED`,
plus the job's `--preload` modules), then says `{"ready": ...}`, or
`{"refused": REASON}` when an import failed or left it unsafe to fork (a
thread beyond the pools the preloads start and stop themselves at fork, such
as OpenBLAS's, or CUDA initialised), and exits. Then it only waits for orders.

An order is one JSON message (the script's `argv`, the command line to show,
its `env`, `cwd`, the agent's rlimits and umask, the agent's pid) carrying
three fds: the worker's
stdin, stdout and stderr. For each order the zygote forks twice: the
intermediate child forks the worker and exits, so the worker is re-parented
to the agent (a child subreaper): the agent waits for it, reads its exit code
and signal, and the worker dies with the agent (PR_SET_PDEATHSIG, armed once
its parent is the agent), not with the zygote. Before the zygote answers
`{"pid": PID}` the worker has its own session (the agent signals its process
group) and has been re-parented. The worker then takes its stdio, rlimits,
umask, environment and cwd, reseeds the random generators a fresh process
would seed, and runs the script from the top as `__main__`
(libworker.warm_start.start): its exit is the script's, through the
interpreter's normal shutdown (atexit, non-daemon threads), as if spawned.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import os
import resource
import signal
import socket
import sys
import threading
import time
from typing import Any

from libworker import warm_start

PRELOADED = (*warm_start.PRELOADED, "numpy")
ORDER_BYTES, ORDER_FDS = 1 << 20, 3
REPARENT_LIMIT = 5.0
PR_SET_PDEATHSIG, PR_SET_MM, PR_SET_MM_MAP = 1, 35, 14
_SHOWN: list[Any] = []  # the blocks /proc/self/cmdline and /proc/self/environ point at: they live as long as the worker


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


def _preload(extra: list[str]) -> tuple[int, str | None]:
    """Import the preloads; the native threads the fork-safe defaults left, and why not to serve (None: serve)."""
    allowed = 0
    for name in (*PRELOADED, *extra):
        try:
            importlib.import_module(name)
        except Exception as exc:
            return allowed, f"{'--preload ' if name in extra else ''}{name}: {type(exc).__name__}: {exc}"
        if name == PRELOADED[-1]:
            allowed = native_threads()
    hazards = fork_hazards(allowed)
    return allowed, "; ".join(hazards) if hazards else None


def serve(sock: socket.socket, allowed_threads: int) -> tuple[dict[str, Any], list[int]]:
    """Answer orders until the agent closes its end (then exit 0); returns only in a forked worker, with its order."""
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
    agent; the worker's pid here (once it has its own session and its new parent), 0 in the worker, -1 on failure."""
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


def become_worker(order: dict[str, Any], fds: list[int]) -> None:
    """In the forked worker: wait to be the agent's child, then die with the agent, and take the order's stdio,
    rlimits, umask and random seeds (the environment, cwd and argv are warm_start.start's)."""
    agent, deadline = int(order["agent_pid"]), time.monotonic() + REPARENT_LIMIT
    while os.getppid() != agent:
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.0005)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != agent:
        os._exit(70)
    for target, fd in enumerate(fds):
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    for name, (soft, hard) in order.get("rlimits", {}).items():
        limit = getattr(resource, name, None)
        if limit is not None and resource.getrlimit(limit) != (soft, hard):
            try:
                resource.setrlimit(limit, (soft, hard))
            except (ValueError, OSError):
                pass
    os.umask(int(order.get("umask", 0o022)))
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    show_in_proc(order.get("cmdline") or [sys.executable, *order["argv"]], order["env"])


class _MmMap(ctypes.Structure):
    """The kernel's struct prctl_mm_map (PR_SET_MM_MAP): where a process's code, data, stack, argv and env lie."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "start_code",
            "end_code",
            "start_data",
            "end_data",
            "start_brk",
            "brk",
            "start_stack",
            "arg_start",
            "arg_end",
            "env_start",
            "env_end",
        )
    ] + [("auxv", ctypes.c_void_p), ("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]


def show_in_proc(argv: list[str], env: dict[str, str]) -> bool:
    """Point /proc/self/cmdline and /proc/self/environ (what ps and top show, and what tools that find a job's
    processes by their environment read) at the worker's command line and environment instead of the zygote's, with
    PR_SET_MM_MAP (the rest of the map as /proc/self/stat has it); False where the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    stat = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()
    field = lambda number: int(stat[number - 3])  # noqa: E731 -- proc(5) numbers the fields from 1, pid and comm first
    blocks = [
        ctypes.create_string_buffer(b"".join(os.fsencode(part) + b"\0" for part in parts))
        for parts in (argv, [f"{name}={value}" for name, value in env.items()])
    ]
    (arg_start, arg_end), (env_start, env_end) = [
        (ctypes.addressof(block), ctypes.addressof(block) + len(block) - 1) for block in blocks
    ]
    mm_map = _MmMap(
        start_code=field(26),
        end_code=field(27),
        start_data=field(45),
        end_data=field(46),
        start_brk=field(47),
        brk=libc.sbrk(0),
        start_stack=field(28),
        arg_start=arg_start,
        arg_end=arg_end,
        env_start=env_start,
        env_end=env_end,
        auxv=None,
        auxv_size=0,
        exe_fd=0xFFFFFFFF,
    )
    if libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.byref(mm_map), ctypes.sizeof(mm_map), 0) != 0:
        return False
    _SHOWN.extend(blocks)
    return True


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m libworker.zygote")
    parser.add_argument("--socket-fd", type=int, required=True)
    parser.add_argument("--preload", default="")
    args = parser.parse_args()
    sock = socket.socket(fileno=args.socket_fd)
    allowed, refusal = _preload([name for name in args.preload.split(",") if name])
    if refusal:
        sock.send(json.dumps({"refused": refusal}).encode())
        sys.exit(3)
    gc.freeze()  # the preloads' objects: a worker's collections never touch (and so never copy) their pages
    sock.send(json.dumps({"ready": True, "pid": os.getpid()}).encode())
    order, fds = serve(sock, allowed)
    sock.close()
    become_worker(order, fds)
    warm_start.start(order)


if __name__ == "__main__":
    main()
