"""Goodput under faults (issue 13): committed samples per second while faults strike, over the same fault-free.

    python -m bench.goodput [--mode all|worker|agent|drain] [--setups default,spawn-1] [--duration 90]
                            [--baseline-duration 45] [--fault-every 15] [--drain-seconds 5]

The default run (a baseline and six chaos runs) takes about 13 minutes;
`--duration 40` about 8.

The job: 3 hosts x 1 slot, `examples/train_elastic.py` (batch 16 per rank,
commit every 4 steps, `--step-delay 0.02`, epochs without end; a step takes
~60 ms on an idle 2-core machine) with
`--blacklist-cooldown 0 0 --max-restarts 1000 --restart-window 1`: the faults
are random, not a crash loop, so no slot backs off and no host stays out.
Intervals are the production defaults (heartbeat 1 s, 3 missed = lost,
discovery poll 1 s, driver tick 0.1 s, collective timeout 60 s). Every run
has a cluster of its own; it starts measuring once the job has trained 20
steps at world size 3 (and, with standbys, once every agent's standby waits
in `init()`), then measures for `--duration` seconds; a fault strikes every
`--fault-every` seconds from the start of the window, each at a random host:
  worker  SIGKILL of the host's worker; its agent restarts the slot in place
  agent   SIGKILL of the host's agent (its workers die with it), then the
          agent is started again at once under the same host name
  drain   `elasticctl drain HOST`, then `elasticctl undrain HOST`
          `--drain-seconds` later
Each mode runs once per agent setup of `--setups`: `default` (the agents'
defaults: the fork server, which forks every worker, and its one standby),
`N` (the fork server and `--standby N`) and `spawn-N` (`--no-fork-server
--standby N`: every worker a fresh interpreter); by default `default` and
`spawn-1`, the reference. The baseline
is one fault-free run of the same job without standbys (setup `0`), measured for
`--baseline-duration` seconds (45 by default: its rate is steady, so half
the chaos window is enough).

Committed samples: the samples of the steps that ended up committed inside
the window. The committed step is rank 0's latest `commit` event, or its
latest round entry (a round resumes from the last commit, which also covers
a commit interrupted by a host update before it was logged). Every step
number after the committed step at the window's start up to the committed
step at its end counts once, with the samples of its last execution (a step
rolled back and redone counts as redone): rank 0's batch length times the
world size of that execution. Goodput ratio = chaos committed samples per
second / baseline committed samples per second.

Printed per run: `GOODPUT mode=M setup=S ratio=R baseline_sps=B
chaos_sps=C faults=N longest_pause_s=P`, then the pauses (gaps between
consecutive rank-0 steps longer than 3x the run's median step, as seconds
into the window: length; a pause still going on when the window ends
counts up to its end), then a load-corrected ratio: each run's committed
samples per second over its rate at full size at its own median full-size
step, the chaos run's over the baseline's (others share this machine's 2
cores, so the baseline's pace and a chaos run's can differ twofold; this
ratio factors that out), then
`fault -> full size again` per fault: from the kill (worker, agent) or the
undrain (drain) to rank 0's first step at world size 3 in a round started
after the fault, then the share of rank 0's steps in the window taken at
world size 3 and how many worker and standby processes the agents forked
and spawned (from their logs).

Every process started here (restarted agents included) is stopped on the way
out, whatever happens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import JOB, cluster
from bench.gpu_smoke import running_pid
from elastic_control_plane.bus.config import Timing
from testing.harness import Cluster, wait_for

HOSTS = ("host-1", "host-2", "host-3")
FULL_SIZE = len(HOSTS)
MODES = ("worker", "agent", "drain")
WARM_UP_STEPS = 20
PAUSE_FACTOR = 3.0
POLL_INTERVAL = 0.2
RESTART_IN_PLACE = ("--blacklist-cooldown", "0", "0", "--max-restarts", "1000", "--restart-window", "1")

Event = dict[str, Any]


class EventTail:
    """The events the job's ranks log, read as they are written: each poll parses only the lines added since
    the last one (the logs grow too large to read whole, again and again, on a busy 2-core machine)."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.offsets: dict[Path, int] = {}

    def poll(self) -> list[Event]:
        """The complete lines added to every rank's log since the last poll, in time order."""
        new: list[Event] = []
        for path in sorted(self.log_dir.glob("*.jsonl")):
            offset = self.offsets.get(path, 0)
            if path.stat().st_size == offset:
                continue
            with open(path, "rb") as file:
                file.seek(offset)
                chunk = file.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self.offsets[path] = offset + len(complete)
            for line in complete.splitlines():
                try:
                    new.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line cut short by a kill
        return sorted(new, key=lambda e: e["time"])

    def wait(self, matches: Callable[[Event], bool], timeout: float, what: str, keep: Callable[[Event], None]) -> Event:
        """Poll until an event `matches`; every event read on the way goes to `keep`. Returns the first match."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = None
            for event in self.poll():
                keep(event)
                if found is None and matches(event):
                    found = event
            if found is not None:
                return found
            time.sleep(POLL_INTERVAL)
        raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


@contextlib.contextmanager
def chaos_cluster(extra_env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """bench.common's `cluster()`, deaf to SIGTERM and SIGINT while it stops its processes: a job runner that
    stops a process group signals this process twice (`timeout` passes its own SIGTERM on), and a second signal
    inside the cleanup would cut it short, leaving services, agents and workers running."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with cluster(extra_env) as c:
            try:
                yield c
            finally:
                for sig in previous:
                    signal.signal(sig, signal.SIG_IGN)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start_job(
    c: Cluster, setup: str, step_delay: float, *job_args: str, options: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], EventTail]:
    """An agent with one slot (and the setup's fork server and spares) on each host, then the example job (with
    `job_args` too; `options` are elasticctl run's), logging its events."""
    for host in HOSTS:
        c.start_agent(host, 1, agent_args(setup))
    log_dir = c.workdir / "train"
    job = c.submit(
        "--min-np",
        "2",
        *RESTART_IN_PLACE,
        *options,
        "--",
        *JOB,
        "--epochs",
        "1000000",
        "--step-delay",
        str(step_delay),
        "--log-dir",
        str(log_dir),
        *job_args,
    )
    return job, EventTail(log_dir)


def agent_args(setup: str) -> list[str]:
    """`default`: the agent's defaults (the fork server and its one standby); `N`: the fork server and N standbys;
    `spawn-N`: `--no-fork-server` and N standbys."""
    if setup == "default":
        return []
    spawn, _, standby = setup.rpartition("-")
    return (["--no-fork-server"] if spawn == "spawn" else []) + ["--standby", standby]


def has_standbys(setup: str) -> bool:
    return setup == "default" or not setup.endswith("-0") and setup != "0"


def wait_for_standbys(c: Cluster) -> None:
    wait_for(
        lambda: all("standby_waiting" in c.output(f"agent-{host}") for host in HOSTS),
        120,
        "every agent's standby to wait in init()",
        interval=POLL_INTERVAL,
    )


def kill_worker(c: Cluster, host: str) -> None:
    try:
        os.kill(running_pid(c, host), signal.SIGKILL)
    except ProcessLookupError:
        pass  # it died on its own meanwhile: the fault happened anyway


def restart_agent(c: Cluster, host: str, setup: str) -> None:
    """SIGKILL the agent of `host` (its workers die with it) and start a new one under the same name; the old
    process is reaped first, since `Cluster.processes` keeps only the newest process of a name."""
    agent = c.processes[f"agent-{host}"]
    agent.kill()
    agent.wait()
    c.start_agent(host, 1, agent_args(setup))


def set_drained(c: Cluster, host: str, drained: bool) -> None:
    command = "drain" if drained else "undrain"
    result = c.elasticctl(command, host)
    if result.returncode != 0:
        raise AssertionError(f"elasticctl {command} {host} failed: {result.stderr or result.stdout}")


@dataclass
class Fault:
    host: str
    at: float  # the kill, or the undrain of a drain: where "back at full size" is measured from
    round_before: int  # the job's round just before `at`


@dataclass
class Run:
    mode: str
    setup: str
    start: float
    end: float
    events: list[Event] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    started: dict[str, int] = field(
        default_factory=dict
    )  # worker and standby processes the agents started: forked, spawned

    def rank0(self, kind: str) -> list[Event]:
        return [e for e in self.events if e["rank"] == 0 and e["event"] == kind]

    def committed_step(self, at: float) -> int:
        """Rank 0's committed step at time `at`: its latest commit or round entry (which resumes from a commit)."""
        marks = [
            e["step"] for e in self.events if e["rank"] == 0 and e["event"] in ("commit", "enter") and e["time"] <= at
        ]
        return max(marks, default=0)

    def committed_samples(self) -> int:
        last_execution: dict[int, int] = {}
        for step in self.rank0("step"):
            if step["time"] <= self.end:
                last_execution[step["step"]] = len(step["indices"]) * step["size"]
        first, last = self.committed_step(self.start), self.committed_step(self.end)
        return sum(last_execution.get(n, 0) for n in range(first + 1, last + 1))

    def samples_per_second(self) -> float:
        return self.committed_samples() / (self.end - self.start)

    def step_gaps(self) -> list[tuple[float, float]]:
        """(time into the window, length) of every gap between consecutive rank-0 steps inside the window, the
        window's edges counting as steps (a pause still going on at the end counts up to the end)."""
        times = [self.start, *(e["time"] for e in self.rank0("step") if self.start <= e["time"] <= self.end), self.end]
        return [(a - self.start, b - a) for a, b in zip(times, times[1:])]

    def median_step(self) -> float:
        gaps = self.step_gaps()
        return statistics.median(length for _, length in gaps) if gaps else float("nan")

    def full_size_rate(self) -> float:
        """Samples per second at full size at this run's own pace: 3 batches per median full-size step. Dividing
        by it factors out how busy the machine was during the run (others share its 2 cores)."""
        steps = [e for e in self.rank0("step") if self.start <= e["time"] <= self.end]
        gaps = [
            b["time"] - a["time"]
            for a, b in zip(steps, steps[1:])
            if a["size"] == b["size"] == FULL_SIZE and a["round"] == b["round"]
        ]
        if not gaps:
            return float("nan")
        return FULL_SIZE * statistics.median(len(e["indices"]) for e in steps) / statistics.median(gaps)

    def full_size_share(self) -> tuple[int, int]:
        """(rank 0's steps at full size, all its steps) inside the window."""
        sizes = [e["size"] for e in self.rank0("step") if self.start <= e["time"] <= self.end]
        return sum(size == FULL_SIZE for size in sizes), len(sizes)

    def back_at_full_size(self, fault: Fault) -> float | None:
        """Seconds from the fault to rank 0's first step at full size in a later round; None if not in the run."""
        for step in self.rank0("step"):
            if step["time"] > fault.at and step["round"] > fault.round_before and step["size"] == FULL_SIZE:
                return step["time"] - fault.at
        return None


def measure(
    mode: str | None,
    setup: str,
    duration: float,
    fault_every: float,
    drain_seconds: float,
    step_delay: float,
    rng: random.Random,
) -> Run:
    """One run in a cluster of its own: warm up, then `duration` seconds with a fault of `mode` every
    `fault_every` seconds (none when `mode` is None)."""
    with chaos_cluster(Timing().as_env()) as c:
        job, tail = start_job(c, setup, step_delay)
        events: list[Event] = []

        def warmed_up(_: Event) -> bool:
            return (
                sum(e["event"] == "step" and e["rank"] == 0 and e["size"] == FULL_SIZE for e in events) >= WARM_UP_STEPS
            )

        tail.wait(warmed_up, 180, f"{WARM_UP_STEPS} steps at world size {FULL_SIZE}", events.append)
        if has_standbys(setup):
            wait_for_standbys(c)
        start = time.time()
        run = Run(mode or "none", setup, start, start + duration)
        next_fault = run.start + fault_every
        while mode is not None and next_fault < run.end:
            time.sleep(max(0.0, next_fault - time.time()))
            host = rng.choice(HOSTS)
            round_before = c.job()["round"]
            if mode == "worker":
                run.faults.append(Fault(host, time.time(), round_before))
                kill_worker(c, host)
            elif mode == "agent":
                run.faults.append(Fault(host, time.time(), round_before))
                restart_agent(c, host, setup)
            else:
                set_drained(c, host, True)
                time.sleep(drain_seconds)
                run.faults.append(Fault(host, time.time(), c.job()["round"]))
                set_drained(c, host, False)
            next_fault += fault_every
        time.sleep(max(0.0, run.end - time.time()))
        run.events = events + tail.poll()
        run.started = processes_started(c)
        c.call("registry", "cancel", {"reason": "benchmark done"})
        c.wait_job_end(job, 30)
    return run


def processes_started(c: Cluster) -> dict[str, int]:
    """How the agents started their workers and standbys, from their logs: forked from the fork server, or spawned."""
    counts = {"forked": 0, "spawned": 0}
    for host in HOSTS:
        for line in c.output(f"agent-{host}").splitlines():
            if '"worker_started"' in line or '"standby_started"' in line:
                with contextlib.suppress(ValueError):
                    counts["forked" if json.loads(line).get("forked") else "spawned"] += 1
    return counts


def report(run: Run, baseline: Run) -> None:
    gaps = run.step_gaps()
    median_step = run.median_step()
    pauses = [(at, length) for at, length in gaps if length > PAUSE_FACTOR * median_step]
    sps, baseline_sps = run.samples_per_second(), baseline.samples_per_second()
    longest = max((length for _, length in gaps), default=0.0)
    print(
        f"GOODPUT mode={run.mode} setup={run.setup} ratio={sps / baseline_sps:.3f} "
        f"baseline_sps={baseline_sps:.1f} chaos_sps={sps:.1f} faults={len(run.faults)} "
        f"longest_pause_s={longest:.2f}"
    )
    print(
        f"  median step {median_step * 1000:.1f} ms; pauses > {PAUSE_FACTOR:g}x it (s into the window: length s): "
        + (", ".join(f"{at:.1f}: {length:.2f}" for at, length in pauses) or "none")
    )
    pace, baseline_pace = sps / run.full_size_rate(), baseline_sps / baseline.full_size_rate()
    print(
        f"  load-corrected ratio {pace / baseline_pace:.3f}: committed / full-size rate at the run's own median "
        f"step {pace:.3f}, baseline's {baseline_pace:.3f}"
    )
    origin = "undrain" if run.mode == "drain" else "kill"
    recoveries = [run.back_at_full_size(f) for f in run.faults]
    print(
        f"  {origin} -> full size again (s): "
        + ", ".join(f"{f.host} {'not in the run' if r is None else f'{r:.2f}'}" for f, r in zip(run.faults, recoveries))
    )
    measured = [r for r in recoveries if r is not None]
    if measured:
        print(f"  {origin} -> full size again: median {statistics.median(measured):.2f} s, max {max(measured):.2f} s")
    at_full_size, all_steps = run.full_size_share()
    print(
        f"  steps at full size: {at_full_size / max(1, all_steps):.3f} ({at_full_size} of {all_steps}); "
        f"processes started: {run.started.get('forked', 0)} forked, "
        f"{run.started.get('spawned', 0)} spawned"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=("all", *MODES), default="all")
    parser.add_argument(
        "--setups",
        default="default,spawn-1",
        help="Agent setups of the chaos runs, comma-separated: default (the fork server "
        "and its one standby), N (the fork server and N standbys), spawn-N (--no-fork-server and N standbys).",
    )
    parser.add_argument("--duration", type=float, default=90.0, help="Seconds measured per chaos run.")
    parser.add_argument("--baseline-duration", type=float, default=45.0, help="Seconds measured in the fault-free run.")
    parser.add_argument("--fault-every", type=float, default=15.0, help="Seconds between faults.")
    parser.add_argument("--drain-seconds", type=float, default=5.0, help="Seconds a drained host stays drained.")
    parser.add_argument("--step-delay", type=float, default=0.02, help="The job's --step-delay.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the choice of hosts to fault.")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    modes = MODES if args.mode == "all" else (args.mode,)
    setups = args.setups.split(",")
    rng = random.Random(args.seed)
    baseline = measure(None, "0", args.baseline_duration, args.fault_every, args.drain_seconds, args.step_delay, rng)
    print(
        f"BASELINE sps={baseline.samples_per_second():.1f} median_step_ms={baseline.median_step() * 1000:.1f} "
        f"duration_s={args.baseline_duration:g}"
    )
    for mode in modes:
        for setup in setups:
            report(
                measure(mode, setup, args.duration, args.fault_every, args.drain_seconds, args.step_delay, rng),
                baseline,
            )


if __name__ == "__main__":
    main()
