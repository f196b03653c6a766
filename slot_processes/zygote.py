"""The host's fork server (a zygote): torch imported once, every worker a `fork()` of it that runs the script.

`python -m elastic_control_plane.slot_processes.zygote --socket-fd N [--preload MODULE,...]` is started by
its agent (agent/fork_server.py) on one end of a SOCK_SEQPACKET socket pair.
It imports what a worker would (torch, DDP, numpy, libworker: `PRELOADED`,
plus the job's `--preload` modules), then says `{"ready": ...}`, or
`{"refused": REASON}` when an import failed or left it unsafe to fork (a
thread beyond the pools the preloads start and stop themselves at fork, such
as OpenBLAS's, or CUDA initialised), and exits. Then it only waits for the
agent's orders (slot_processes/forking.py's protocol): each forked worker is
re-parented to the agent, dies with the agent, not with the zygote, and runs
its script from the top as `__main__` (slot_processes/warm_start.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import socket
import sys

from elastic_control_plane.slot_processes import forking, warm_start

PRELOADED = (*warm_start.PRELOADED, "numpy")


def _preload(extra: list[str]) -> tuple[int, str | None]:
    """Import the preloads; the native threads the fork-safe defaults left, and why not to serve (None: serve)."""
    allowed = 0
    for name in (*PRELOADED, *extra):
        try:
            importlib.import_module(name)
        except Exception as exc:
            return allowed, f"{'--preload ' if name in extra else ''}{name}: {type(exc).__name__}: {exc}"
        if name == PRELOADED[-1]:
            allowed = forking.native_threads()
    hazards = forking.fork_hazards(allowed)
    return allowed, "; ".join(hazards) if hazards else None


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic_control_plane.slot_processes.zygote")
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
    order, fds = forking.serve(sock, allowed)
    sock.close()
    warm_start.run(order, fds)


if __name__ == "__main__":
    main()
