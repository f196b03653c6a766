"""Run a script in an interpreter that has already imported torch: what a forked worker does once it is on its own.

A process forked from a zygote (libworker/zygote.py: the host's fork server, or a torchrun-mode supervisor's seed,
agent/torchrun_slot.py) ends in `start(order)`: it takes the order's environment as its own (and, when it names
OMP_NUM_THREADS, the thread count torch would have read from it at start), goes to the order's `cwd` and runs the
script (`argv`: a script's path or `-m MODULE`, then its arguments) as `python SCRIPT ARGS` would, as `__main__`
(runpy). Its exit is the script's. `PRELOADED` is what the zygote imports for it: torch, torch.distributed, DDP,
what a first optimizer imports, and libworker; never CUDA.
"""

from __future__ import annotations

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
