"""A worker that writes down what kind of process it is, then joins the job and ends: written like a user's script
that does work before `init()` (a thread of its own started, a torch op run, so torch's thread pool is up), to
compare a forked worker with a spawned one. `REPORT_DIR/<local rank>.json` gets its pid and parent, session and
process group, cwd, argv, `__name__`, environment, what /proc/self/cmdline and /proc/self/environ show, signal
mask and dispositions, rlimits, umask, and draws from Python's, numpy's and torch's random generators."""

import json
import os
import random
import resource
import sys
import threading
from pathlib import Path

import numpy
import torch

import libworker as hvd

heartbeat = threading.Event()
threading.Thread(target=heartbeat.wait, name="user-heartbeat", daemon=True).start()
torch.ones(64, 64) @ torch.ones(64, 64)


def proc_status(*names: str) -> dict[str, str]:
    lines = Path("/proc/self/status").read_text().splitlines()
    return {name: line.split(":", 1)[1].strip() for line in lines for name in names if line.startswith(name + ":")}


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


report = {
    "pid": os.getpid(),
    "ppid": os.getppid(),
    "sid": os.getsid(0),
    "pgid": os.getpgid(0),
    "cwd": os.getcwd(),
    "argv": sys.argv,
    "name": __name__,
    "path0": sys.path[0],
    "env": dict(os.environ),
    "proc_cmdline": Path("/proc/self/cmdline").read_bytes().decode().split("\0")[:-1],
    "proc_environ": sorted(Path("/proc/self/environ").read_bytes().decode().split("\0")[:-1]),
    "signals": proc_status("SigBlk", "SigIgn", "SigCgt"),
    "rlimits": {
        name: resource.getrlimit(getattr(resource, name)) for name in ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_STACK")
    },
    "umask": umask(),
    "python_random": random.random(),
    "numpy_random": float(numpy.random.rand()),
    "torch_threads": torch.get_num_threads(),
}
hvd.init()
Path(os.environ["REPORT_DIR"], f"{os.environ['LOCAL_RANK']}.json").write_text(json.dumps(report))
hvd.allreduce(torch.ones(1), name="done")
