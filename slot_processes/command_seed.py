"""A torchrun-mode slot's command seed: a copy of the slot's supervisor, made before it starts any thread, that forks
each round's command (and the round's store server) on order.

A supervisor forked from its host's zygote (slot_processes/zygote.py) has torch imported but cannot fork its commands
itself once it runs threads (the agent link's, a zmq context), and the zygote's forks are re-parented to the agent, not
to the supervisor that must wait for them. So the supervisor's first act is `CommandSeed()`: it becomes a child
subreaper and forks the seed, which answers orders with slot_processes/forking.py's protocol (`serve`): each order is
forked twice, re-parented to the supervisor, takes its stdio, dies with the supervisor and runs its script as `__main__`
(slot_processes/warm_start.py). The seed shares the zygote's pages and dies with the supervisor.
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import socket
import sys
from collections.abc import Mapping

from elastic_control_plane.bus.lifetime import PR_SET_PDEATHSIG
from elastic_control_plane.slot_processes import warm_start
from elastic_control_plane.slot_processes.forking import (
    PR_SET_CHILD_SUBREAPER,
    ForkedProcess,
    current_umask,
    native_threads,
    send_order,
    serve,
)


class SeedGone(Exception):
    """The seed cannot fork: it died, or refused the order."""


class CommandSeed:
    """A fork of this supervisor, made before it starts any thread, that forks each round's command on order (the
    zygote's protocol, with this supervisor as the parent the command is re-parented to)."""

    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        supervisor = os.getpid()
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.pid = os.fork()
        if self.pid == 0:
            self.sock.close()
            _serve_as_seed(theirs, supervisor)
        theirs.close()

    def fork(
        self, command: list[str], env: Mapping[str, str], stdio: tuple[int, int, int] = (0, 1, 2)
    ) -> ForkedProcess:
        """`command` forked from the seed, on this supervisor's stdio or `stdio`; SeedGone if the seed cannot serve."""
        order = {
            "argv": command[1:],
            "cmdline": command,
            "env": dict(env),
            "cwd": os.getcwd(),
            "agent_pid": os.getpid(),
            "umask": current_umask(),
        }
        try:
            return ForkedProcess(send_order(self.sock, order, list(stdio)))
        except (OSError, ValueError) as exc:
            raise SeedGone(f"the command seed cannot fork ({exc or type(exc).__name__})") from exc

    def close(self) -> None:
        self.sock.close()
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _serve_as_seed(sock: socket.socket, supervisor: int) -> None:
    """In the seed: wait for orders until the supervisor closes its end or dies; in a command forked from it, run
    the script and exit as it does, never returning into the supervisor's code."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor:
        os._exit(0)
    gc.freeze()
    order, fds = serve(sock, native_threads())
    sock.close()
    warm_start.run(order, fds)
    sys.exit(0)
