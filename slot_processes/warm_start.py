"""What a process forked from a warm interpreter does once it is on its own: become the worker its order describes,
then run its script as `python SCRIPT ARGS` would, in an interpreter that has already imported torch.

A process forked by slot_processes/forking.py's `serve` (in the host's zygote, slot_processes/zygote.py, or in a
torchrun-mode supervisor's seed, slot_processes/command_seed.py) ends in `run(order, fds)`. First `become_worker`: it
waits to be the child of the process that ordered it, dies with that process (PR_SET_PDEATHSIG, armed once it is its
parent), takes its stdio, rlimits and umask, reseeds the random generators a fresh process would seed, and shows the
order's command line and environment in /proc. Then `start`: it takes the order's environment as its own (and, when it
names OMP_NUM_THREADS, the thread count torch would have read from it at start), goes to the order's `cwd` and runs the
script (`argv`: a script's path or `-m MODULE`, then its arguments, as `script_argv` reads them from a command) as
`__main__` (runpy). Its exit is the script's, through the interpreter's normal shutdown (atexit, non-daemon threads), as
if spawned. `PRELOADED` is what a warm interpreter imports for it: torch, torch.distributed, DDP, what a first optimizer
imports, and libworker; never CUDA. Before the script runs, the modules only the warm interpreter needed
(`SERVER_MODULES`: the order protocol, this module, the zygote) leave `sys.modules`: the script imports what a spawned
worker would, and nothing else of ours (every name of ours is under `elastic_control_plane`, or is `libworker`: a user's
`agent.py` is the user's).
"""

from __future__ import annotations

import ctypes
import os
import resource
import runpy
import signal
import sys
import time
from typing import Any

from elastic_control_plane.bus.lifetime import PR_SET_PDEATHSIG

# torch._dynamo: the first optimizer a script builds imports it (some 800 modules, ~2 s here on torch 2.13).
PRELOADED = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "libworker")
SERVER_MODULES = tuple(f"{__package__}.{name}" for name in ("forking", "warm_start", "zygote", "command_seed"))
REPARENT_LIMIT = 5.0
PR_SET_MM, PR_SET_MM_MAP = 35, 14
_SHOWN: list[Any] = []  # the blocks /proc/self/cmdline and /proc/self/environ point at: they live as long as the worker


def script_argv(command: list[str]) -> list[str] | None:
    """The arguments a warm interpreter runs for `python SCRIPT ARGS` or `python -m MODULE ARGS`; None for anything
    else (interpreter options, another program)."""
    if len(command) < 2 or not os.path.basename(command[0]).startswith("python"):
        return None
    if command[1] == "-m":
        return command[1:] if len(command) > 2 else None
    return command[1:] if not command[1].startswith("-") else None


def run(order: dict[str, Any], fds: list[int]) -> None:
    """In the forked worker: become the order's worker and run its script."""
    become_worker(order, fds)
    start(order)


def become_worker(order: dict[str, Any], fds: list[int]) -> None:
    """In the forked worker: wait to be the ordering process's child, then die with it, and take the order's stdio,
    rlimits, umask and random seeds (the environment, cwd and argv are `start`'s)."""
    parent, deadline = int(order["agent_pid"]), time.monotonic() + REPARENT_LIMIT
    while os.getppid() != parent:
        if time.monotonic() > deadline:
            os._exit(70)
        time.sleep(0.0005)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
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


def start(order: dict[str, Any]) -> None:
    argv, env, cwd = list(order["argv"]), dict(order["env"]), order["cwd"]
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))
    for name in SERVER_MODULES:
        sys.modules.pop(name, None)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")
