"""The goodput ledger against the job's own clock (issue 49): a job with injected faults, its ledger's training share
and lost work over a window, and the same measured from what the ranks logged, with a fault-free baseline's
committed samples per second in the same run.

    python -m bench.goodput_ledger [--duration 60] [--fault-every 10] [--baseline-duration 30] [--drain-seconds 3]

The job and cluster are bench/goodput.py's (3 hosts x 1 slot, `examples/train_elastic.py`, production intervals,
the agents' defaults), with `--commit-every` steps between commits (default 20: about a second). Faults cycle
through a worker SIGKILL (restarted in place), a drain (undrained `--drain-seconds` later), an agent SIGKILL
(started again at once), a hang (a worker SIGSTOPped: the registry kills it at the job's `--hung-timeout`, 10 s) and
a lost host (its agent SIGSTOPped for `--drain-seconds` + 3 s: lost after three missed heartbeats, back when it
resumes), each at a random host, every `--fault-every` seconds of the `--duration` window: the causes crash, drain,
scale_up, hang and lost_host.

The ledger over the window: the difference of the registry's `ledger` read at its start and at its end. Its
training is training + training below size + checkpointing (a commit's save happens inside a step as the ranks see
it).

Measured from rank 0's step log: the time between consecutive steps is the later step's, at most PAUSE_FACTOR x
the median step (a round's first step: one median step); the rest of a longer gap is a stall. A step executed
again later (rolled back by a fault) is lost work. Measured training = the kept steps' time; the rest of the
window is interruptions. Then bench/goodput.py's committed samples per second over the baseline's (plain and
load-corrected: each run over its own full-size rate).

Every process started here is stopped on the way out, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import time
from typing import Any

from bench.goodput import (
    HOSTS,
    PAUSE_FACTOR,
    WARM_UP_STEPS,
    Event,
    Run,
    chaos_cluster,
    has_standbys,
    kill_worker,
    measure,
    restart_agent,
    set_drained,
    start_job,
    wait_for_standbys,
)
from bench.gpu_smoke import running_pid
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.services.registry.ledger import BELOW_SIZE, BUCKETS, CHECKPOINTING, LOST_WORK, TRAINING
from testing.harness import Cluster

SETUP = "default"
FAULTS = ("worker", "drain", "agent", "hang", "lost")
HUNG_TIMEOUT = 10.0


def ledger(c: Cluster) -> dict[str, Any]:
    return c.call("registry", "ledger")["goodput"]


def chaos(
    duration: float, fault_every: float, drain_seconds: float, step_delay: float, commit_every: int, rng: random.Random
) -> tuple[Run, dict[str, Any], list[str]]:
    """The window's ledger (the difference of its buckets), its run (the ranks' events) and the faults injected."""
    with chaos_cluster(Timing().as_env()) as c:
        options = ("--hung-timeout", str(HUNG_TIMEOUT))
        job, tail = start_job(c, SETUP, step_delay, "--commit-every", str(commit_every), options=options)
        events: list[Event] = []
        tail.wait(
            lambda _: (
                sum(e["event"] == "step" and e["rank"] == 0 and e["size"] == len(HOSTS) for e in events)
                >= WARM_UP_STEPS
            ),
            180,
            "warm-up steps at full size",
            events.append,
        )
        if has_standbys(SETUP):
            wait_for_standbys(c)
        before, start = ledger(c), time.time()
        run, injected = Run("mixed", SETUP, start, start + duration), []
        next_fault, kinds = start + fault_every, iter(FAULTS * 100)
        while next_fault + drain_seconds < run.end:
            time.sleep(max(0.0, next_fault - time.time()))
            kind, host = next(kinds), rng.choice(HOSTS)
            injected.append(f"{kind}@{host}")
            if kind == "worker":
                kill_worker(c, host)
            elif kind == "agent":
                restart_agent(c, host, SETUP)
            elif kind == "hang":
                os.kill(running_pid(c, host), signal.SIGSTOP)
            elif kind == "lost":
                agent = c.processes[f"agent-{host}"]
                agent.send_signal(signal.SIGSTOP)
                time.sleep(drain_seconds + 3)
                agent.send_signal(signal.SIGCONT)
            else:
                set_drained(c, host, True)
                time.sleep(drain_seconds)
                set_drained(c, host, False)
            next_fault += fault_every
        time.sleep(max(0.0, run.end - time.time()))
        after = ledger(c)
        run.end = time.time()
        run.events = events + tail.poll()
        c.call("registry", "cancel", {"reason": "benchmark done"})
        c.wait_job_end(job, 30)
    window: dict[str, Any] = {bucket: after["buckets"][bucket] - before["buckets"][bucket] for bucket in BUCKETS}
    window["wall"] = after["wall_s"] - before["wall_s"]
    window["interruptions"] = [entry for entry in after["interruptions"] if entry["at"] and entry["at"] >= start]
    return run, window, injected


def measured(run: Run) -> dict[str, Any]:
    """Training (kept steps) and lost work (steps executed again later) from rank 0's steps in the window, and each
    stall: where, its seconds beyond a step, and the seconds of steps before it that were done again."""
    steps = [e for e in run.rank0("step") if run.start <= e["time"] <= run.end]
    pairs = list(zip(steps, steps[1:]))
    median = statistics.median(b["time"] - a["time"] for a, b in pairs if a["round"] == b["round"])
    last_execution = {e["step"]: e["time"] for e in steps}
    training = lost = redone_since_stall = 0.0
    stalls: list[tuple[float, float, float]] = []
    for a, b in pairs:
        gap = b["time"] - a["time"]
        # A round's first step is one step long; a step of a round no longer than PAUSE_FACTOR steps.
        step = min(gap, median if a["round"] != b["round"] else PAUSE_FACTOR * median)
        if gap > step:
            stalls.append((b["time"] - run.start, gap - step, redone_since_stall))
            redone_since_stall = 0.0
        if last_execution[b["step"]] > b["time"]:
            lost, redone_since_stall = lost + step, redone_since_stall + step
        else:
            training += step
    return {
        "training": training,
        "lost_work": lost,
        "window": run.end - run.start,
        "median_step": median,
        "stalls": stalls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for flag, default, meaning in (
        ("--duration", 60.0, "Seconds of the measured window."),
        ("--fault-every", 10.0, "Seconds between faults."),
        ("--baseline-duration", 30.0, "Seconds of the fault-free run."),
        ("--drain-seconds", 3.0, "Seconds a drained host stays drained."),
        ("--step-delay", 0.02, "The job's --step-delay."),
        ("--commit-every", 20, "The job's --commit-every (steps)."),
        ("--seed", 0, "Seed of the choice of hosts to fault."),
    ):
        parser.add_argument(flag, type=type(default), default=default, help=meaning)
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    rng = random.Random(args.seed)
    baseline = measure(None, "0", args.baseline_duration, args.fault_every, args.drain_seconds, args.step_delay, rng)
    run, window, injected = chaos(
        args.duration, args.fault_every, args.drain_seconds, args.step_delay, args.commit_every, rng
    )
    seen = measured(run)
    ledger_training = window[TRAINING] + window[BELOW_SIZE] + window[CHECKPOINTING]
    print(f"FAULTS {len(injected)}: {' '.join(injected)}")
    print(
        f"LEDGER window_s={window['wall']:.2f} training_share={ledger_training / window['wall']:.3f} "
        f"training_s={ledger_training:.2f} lost_work_s={window[LOST_WORK]:.2f} "
        + " ".join(f"{bucket}_s={window[bucket]:.2f}" for bucket in BUCKETS if bucket not in (TRAINING, LOST_WORK))
    )
    for entry in window["interruptions"]:
        print(
            f"  ledger {entry['at'] - run.start:6.1f}s {entry['cause']:<10} {entry['host']:<7} "
            f"detecting {entry['detecting']:.2f} reforming {entry['reforming']:.2f} lost {entry['lost_work']:.2f}"
        )
    print(
        f"MEASURED window_s={seen['window']:.2f} training_share={seen['training'] / seen['window']:.3f} "
        f"training_s={seen['training']:.2f} lost_work_s={seen['lost_work']:.2f} "
        f"median_step_ms={seen['median_step'] * 1000:.1f}"
    )
    for at, paused, rolled_back in seen["stalls"]:
        print(f"  steps  {at:6.1f}s stalled {paused:.2f} after {rolled_back:.2f} s of steps done again")
    sps, baseline_sps = run.samples_per_second(), baseline.samples_per_second()
    pace, baseline_pace = sps / run.full_size_rate(), baseline_sps / baseline.full_size_rate()
    print(
        f"THROUGHPUT committed samples/s {sps:.1f} vs fault-free {baseline_sps:.1f}: ratio {sps / baseline_sps:.3f}, "
        f"load-corrected {pace / baseline_pace:.3f}"
    )
    print(
        f"DIFFERENCE training_share {ledger_training / window['wall'] - seen['training'] / seen['window']:+.3f}, "
        f"lost_work {window[LOST_WORK] - seen['lost_work']:+.2f} s"
    )


if __name__ == "__main__":
    main()
