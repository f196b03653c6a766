"""A warm interpreter for a torchrun-mode slot: torch imported ahead of the round, the script run when it starts.

A torchrun-mode slot's supervisor (agent/torchrun_slot.py) keeps one of these waiting while its command runs:
`python -m libworker.warm_start` imports torch, torch.distributed, DDP, what a first optimizer imports and
libworker (`PRELOADED`), never
touches CUDA, and then blocks reading one JSON line on stdin: the command's `argv` (a script's path or `-m
MODULE`, then its arguments), `env` and `cwd`. It takes that environment as its own (and, when it names
OMP_NUM_THREADS, the thread count torch would have read from it at start), goes to `cwd` and runs the script as
`python SCRIPT ARGS` would, as `__main__` (runpy): so the next round's command starts without paying for a fresh
interpreter and `import torch`. Its exit is the script's. An end of input without a line (the supervisor is done
with it) exits 0 without running anything.
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from typing import Any

# torch._dynamo: the first optimizer a script builds imports it (some 800 modules, ~2 s here on torch 2.13).
PRELOADED = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo", "libworker")


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
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def main() -> None:
    for name in PRELOADED:
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line.strip():
        sys.exit(0)
    start(json.loads(line))


if __name__ == "__main__":
    main()
