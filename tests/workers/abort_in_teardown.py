"""A script whose work succeeds, then whose process dies of SIGABRT in the interpreter's teardown: the way a C++
thread left joinable at exit ends a process ("terminate called without an active exception"). Its handler is
registered before `hvd.init()`, so it runs after libworker's own exit handlers (they run last-in, first-out)."""

import atexit
import os
import signal

import torch

atexit.register(os.kill, os.getpid(), signal.SIGABRT)

import libworker as hvd  # noqa: E402  (the handler above must be registered first)

hvd.init()
total = hvd.allreduce(torch.ones(3), op=hvd.Sum)
print(f"rank {hvd.rank()} of {hvd.size()}: allreduce gave {total.tolist()}", flush=True)
