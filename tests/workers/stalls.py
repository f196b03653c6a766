"""A Horovod-style elastic training loop with the mistakes that stop a job without killing it, chosen by options.

    --hang-at STEP --hang-host HOST --hang {lock,native,deaf,stopped} --hang-once FILE [--stopped-s S]
        the worker on HOST stops at STEP in its own code, once (FILE marks that it did: its replacement trains):
        lock: it waits on a lock it already holds (a deadlock in its data loading); native: a native call that
        never returns and holds the GIL (what a hung GPU kernel looks like to Python); deaf: a deadlock after it
        ignored the stack-dump signal (as a library that takes every signal for itself would make it); stopped:
        SIGSTOP reaches it inside an all-reduce every rank makes at STEP (the others join it 1.5 s later, so every
        rank's record says it waits), and SIGCONT S seconds later when --stopped-s is given (a debugger's look).
    --pause-every N --pause-s S      every rank pauses S seconds every N steps (an evaluation)
    --slow-host HOST --slow-every N --slow-s S   that host's rank sleeps S seconds every N steps (slow data)
    --lag-host HOST --lag-s S       that host's rank takes S seconds longer every step (a straggler)
    --innocent HOST:WHEN:KIND:S     that host's rank waits S seconds in its own code, legitimately (KIND: one of
                                    tests/workers/innocent_waits.py), WHEN: after step N, "first" (the first step of
                                    each of its lives), or "replacement" (the first step of a life that began in a
                                    running job: a restarted rank); repeatable
    --crash HOST:STEP --crash-once-dir DIR   the worker on HOST exits 3 after STEP, once (a file in DIR marks that
                                    it did: its replacement trains); repeatable

Each step sleeps --step-s (the work of a step). Steps, commits and round entries are logged as JSON lines like
examples/train_elastic.py's, which the tests read.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from innocent_waits import KINDS  # noqa: E402
from train import make_data, make_model  # noqa: E402
from train_elastic import EventLog  # noqa: E402

import libworker as elastic  # noqa: E402
from elastic_control_plane.slot_processes.wait_record import STACK_DUMP_SIGNAL  # noqa: E402

_loader_lock = threading.Lock()


def load_next_batch_deadlocked() -> None:
    """A data loader that takes its own lock twice: the worker stops here, alive and silent."""
    with _loader_lock:
        with _loader_lock:
            pass


def wait_for_the_gpu_forever() -> None:
    """A native call that holds the GIL and never returns, as a hung kernel would keep a synchronizing thread."""
    while True:
        ctypes.PyDLL(None).sleep(1_000_000)  # a signal's handler ends one sleep, not the wait


def stop_me_inside_the_next_collective(stopped_s: float | None) -> None:
    """SIGSTOP to this process half a second from now (from a child: a stopped process sends nothing), SIGCONT
    `stopped_s` later when given."""
    me = os.getpid()
    script = f"sleep 0.5; kill -STOP {me}" + (f"; sleep {stopped_s}; kill -CONT {me}" if stopped_s else "")
    subprocess.Popen(["sh", "-c", script])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--commit-every", type=int, default=5)
    parser.add_argument("--log-dir")
    parser.add_argument("--hang-at", type=int, default=0)
    parser.add_argument("--hang-host")
    parser.add_argument("--hang", choices=("lock", "native", "deaf", "stopped"), default="lock")
    parser.add_argument("--hang-once")
    parser.add_argument("--stopped-s", type=float)
    parser.add_argument("--pause-every", type=int, default=0)
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--slow-host")
    parser.add_argument("--slow-every", type=int, default=0)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--lag-host")
    parser.add_argument("--lag-s", type=float, default=0.0)
    parser.add_argument("--innocent", action="append", default=[])
    parser.add_argument("--crash", action="append", default=[])
    parser.add_argument("--crash-once-dir")
    args = parser.parse_args()

    x, y = make_data(256)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.MSELoss()
    elastic.init()
    log = EventLog(args.log_dir)
    optimizer = elastic.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    state = elastic.TorchState(model=model, optimizer=optimizer, step=0)
    host = os.environ.get("ELASTIC_HOST")

    innocent = [(h, when, KINDS[kind], float(s)) for h, when, kind, s in (i.split(":") for i in args.innocent)]
    life = {"first_step": None}

    def innocent_waits(step: int) -> None:
        """This host's legitimate waits due after `step`, each logged before and after."""
        if life["first_step"] is None:
            life["first_step"] = step
        first = step == life["first_step"]
        for name, when, wait, seconds in innocent:
            due = when == str(step) or (when == "first" and first) or (when == "replacement" and first and step > 1)
            if name == host and due:
                log.write("innocent_wait", step=step, kind=wait.__name__, seconds=seconds)
                wait(seconds)
                log.write("innocent_wait_done", step=step, kind=wait.__name__)

    def should_crash(step: int) -> bool:
        if f"{host}:{step}" not in args.crash or not args.crash_once_dir:
            return False
        crashed = Path(args.crash_once_dir) / f"crashed-{host}"
        if crashed.exists():
            return False
        crashed.touch()
        return True

    def should_hang(step: int) -> bool:
        if step != args.hang_at or host != args.hang_host or not args.hang_once:
            return False
        if Path(args.hang_once).exists():
            return False
        Path(args.hang_once).touch()
        return True

    @elastic.run
    def train(state: elastic.TorchState) -> None:
        log.write("enter", step=state.step)
        while state.step < args.steps:
            rows = slice((state.step * 8) % 248, (state.step * 8) % 248 + 8)
            optimizer.zero_grad()
            loss_fn(model(x[rows]), y[rows]).backward()
            optimizer.step()
            state.step += 1
            log.write("step", step=state.step)
            time.sleep(args.step_s + (args.lag_s if host == args.lag_host else 0.0))
            innocent_waits(state.step)
            if should_crash(state.step):
                log.write("crashing", step=state.step)
                os._exit(3)
            if args.hang == "stopped" and state.step == args.hang_at:
                if should_hang(state.step):
                    log.write("hanging", step=state.step, how=args.hang)
                    stop_me_inside_the_next_collective(args.stopped_s)
                else:
                    time.sleep(1.5)
                elastic.allreduce(torch.zeros(1), name="hang_point")
                log.write("hang_point_passed", step=state.step)
            elif should_hang(state.step):
                log.write("hanging", step=state.step, how=args.hang)
                if args.hang == "native":
                    wait_for_the_gpu_forever()
                if args.hang == "deaf":
                    signal.signal(STACK_DUMP_SIGNAL, signal.SIG_IGN)
                load_next_batch_deadlocked()
            if args.pause_every and state.step % args.pause_every == 0:
                time.sleep(args.pause_s)
            if args.slow_every and host == args.slow_host and state.step % args.slow_every == 0:
                time.sleep(args.slow_s)
            if state.step % args.commit_every == 0:
                state.commit()
                log.write("commit", step=state.step)

    train(state)
    log.write("done", step=state.step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
