"""Soak (issue 13): many resets of one job under mixed faults; what every long-lived process holds as they pile up,
and whether a committed step is ever lost. Not run in CI.

    python -m bench.soak [--resets 1000] [--sample-every 10] [--setup default|N|spawn-N] [--step-delay 0.02]

The job: 3 hosts x 1 slot, `examples/train_elastic.py` (epochs without end),
restarting crashed slots in place (`--blacklist-cooldown 0 0
--max-restarts 1000 --restart-window 1`), with the harness's short intervals
(heartbeat 0.2 s) so resets come quickly. A reset is one fault and then the
job back at full size: a commit at world size 3 in a round started after the
fault. The faults take turns:
  worker  SIGKILL of the worker of host-2 or host-3 (at random)
  drain   `elasticctl drain` of host-2 or host-3, and `undrain` once the job
          steps without it
  agent   SIGKILL of host-3's agent (its workers die with it), started again
          at once under the same name
host-1 is never faulted, so its worker lives through every reset (the
survivor); host-2's agent lives through the crashes and drains of its own
slot. host-3's agent is a new process after every agent fault (its row
follows the newest one, and counts the pids it had).

Every `--sample-every` resets (and before the first), with the job at full
size (the survivor's fds depend on the world size: gloo connects every pair
of ranks), each process is sampled: open fds (/proc/PID/fd), threads and RSS
(/proc/PID/status): the survivor, the three agents (tracked by name, not
pid), their fork servers (the agent's zygote child; host-3's is a new one
after every agent fault) and the four services. `--setup` is the agents'
setup as in bench.goodput: `default` (the fork server and its one standby),
`N` (the fork server, N standbys), `spawn-N` (`--no-fork-server`, N
standbys). Printed per process: the values at the first and
last sample, the growth per reset as the least-squares slope over the samples
and as (last - first) / resets. Then, per fault, the median and longest time
from the fault to the job back at full size: a replacement process starts
and imports torch, 6 s a reset on this 2-core machine (more while other work
runs), so 1000 resets take about two hours; `--resets 30` checks the bench
in a few minutes.

The last line: `SOAK resets=N rounds=R committed_step_lost=no|yes
final_committed_step=S survivor_fds_per_reset=... survivor_threads_per_reset=...
survivor_rss_kb_per_reset=...`. A committed step is lost when, in the
events of every rank in time order, a commit's step is below an earlier
commit's, or a round resumes before the last commit (the check of
tests/integration/training.py `assert_training_invariants`).

Every process started here (restarted agents included) is stopped on the way
out, whatever happens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.goodput import (
    FULL_SIZE,
    Event,
    EventTail,
    chaos_cluster,
    has_standbys,
    kill_worker,
    restart_agent,
    set_drained,
    start_job,
    wait_for_standbys,
)
from bench.gpu_smoke import running_pid
from testing.harness import SERVICES, Cluster

FAULTS = ("worker", "drain", "agent")
FAULTED_HOSTS = ("host-2", "host-3")
AGENT_FAULTED_HOST = "host-3"
RESET_TIMEOUT = 180.0
USAGE = ("fds", "threads", "rss_kb")


def usage(pid: int) -> dict[str, int]:
    status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": int(status["Threads"]),
        "rss_kb": int(status["VmRSS"].split()[0]),
    }


@dataclass
class Series:
    """One process's usage, sampled by name: `pid_of` says which process holds the name now."""

    name: str
    pid_of: Callable[[], int]
    pids: set[int] = field(default_factory=set)
    resets: list[int] = field(default_factory=list)
    values: list[dict[str, int]] = field(default_factory=list)

    def sample(self, reset: int) -> None:
        pid = self.pid_of()
        self.pids.add(pid)
        self.resets.append(reset)
        self.values.append(usage(pid))

    def per_reset(self, key: str) -> tuple[float, float]:
        """Growth of `key` per reset: the least-squares slope over the samples, and (last - first) / resets."""
        ys = [v[key] for v in self.values]
        span = self.resets[-1] - self.resets[0]
        return statistics.linear_regression(self.resets, ys).slope, (ys[-1] - ys[0]) / span

    def report(self) -> str:
        parts = []
        for key in USAGE:
            slope, average = self.per_reset(key)
            parts.append(f"{key} {self.values[0][key]} -> {self.values[-1][key]} ({slope:+.3f}, {average:+.3f})")
        return f"  {self.name:<18} pids={len(self.pids):<4} " + "   ".join(parts)


def watched_processes(c: Cluster, survivor: int, fork_server: bool) -> list[Series]:
    def process(name: str) -> Callable[[], int]:
        return lambda: c.processes[name].pid

    def survivor_pid() -> int:
        pid = running_pid(c, "host-1")
        if pid != survivor:
            raise AssertionError(f"host-1's worker, never faulted, was replaced: pid {survivor} -> {pid}")
        return pid

    def zygote(name: str) -> Callable[[], int]:
        return lambda: zygote_of(c.processes[name].pid)

    hosts = ("host-1", *FAULTED_HOSTS)
    agents = [Series(f"agent-{host}", process(f"agent-{host}")) for host in hosts]
    zygotes = [Series(f"zygote-{host}", zygote(f"agent-{host}")) for host in hosts] if fork_server else []
    return [Series("survivor (host-1)", survivor_pid), *agents, *zygotes, *(Series(s, process(s)) for s in SERVICES)]


def zygote_of(agent: int) -> int:
    """The pid of the agent's fork server: its child running the zygote (slot_processes.zygote)."""
    for pid in os.listdir("/proc"):
        try:
            if (
                pid.isdigit()
                and b"elastic_control_plane.slot_processes.zygote" in open(f"/proc/{pid}/cmdline", "rb").read()
                and parent_of(int(pid)) == agent
            ):
                return int(pid)
        except OSError:
            continue
    raise AssertionError(f"agent {agent} has no fork server")


def parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[1])


def committed_step_lost(marks: list[tuple[float, str, int, int]]) -> str | None:
    """The first place where a committed step went back, in (time, event, step, round) commit and enter marks."""
    last_commit = 0
    for _, event, step, round_number in sorted(marks):
        if step < last_commit:
            return f"round {round_number}: {event} at step {step} after commit {last_commit}"
        if event == "commit":
            last_commit = step
    return None


class Soak:
    def __init__(self, c: Cluster, tail: EventTail, setup: str, rng: random.Random) -> None:
        self.c, self.tail, self.setup, self.rng = c, tail, setup, rng
        self.marks: list[tuple[float, str, int, int]] = []
        self.durations: dict[str, list[float]] = {fault: [] for fault in FAULTS}

    def keep(self, event: Event) -> None:
        if event["event"] in ("commit", "enter"):
            self.marks.append((event["time"], event["event"], event["step"], event["round"]))

    def wait_for(self, kind: str, size: int, after_round: int, what: str) -> Event:
        """The first `kind` event (step, commit) at world size `size` in a round after `after_round`."""
        return self.tail.wait(
            lambda e: e["event"] == kind and e["size"] == size and e["round"] > after_round,
            RESET_TIMEOUT,
            what,
            self.keep,
        )

    def back_at_full_size(self, after_round: int) -> None:
        self.wait_for("commit", FULL_SIZE, after_round, f"a commit at world size {FULL_SIZE} after round {after_round}")

    def reset(self, fault: str) -> None:
        """Inject `fault` and return once the job is back at full size."""
        host = AGENT_FAULTED_HOST if fault == "agent" else self.rng.choice(FAULTED_HOSTS)
        started = time.monotonic()
        round_before = self.c.job()["round"]
        if fault == "worker":
            kill_worker(self.c, host)
        elif fault == "agent":
            restart_agent(self.c, host, self.setup)
        else:
            set_drained(self.c, host, True)
            round_before = self.wait_for("step", FULL_SIZE - 1, round_before, f"steps without {host}")["round"]
            set_drained(self.c, host, False)
        self.back_at_full_size(round_before)
        self.durations[fault].append(time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--resets", type=int, default=1000)
    parser.add_argument("--sample-every", type=int, default=10, help="Resets between samples.")
    parser.add_argument(
        "--setup", default="default", help="The agents' setup: default, N or spawn-N (as bench.goodput's --setups)."
    )
    parser.add_argument("--step-delay", type=float, default=0.02, help="The job's --step-delay.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the choice of hosts to fault.")
    args = parser.parse_args()
    if args.resets < args.sample_every:
        parser.error("--resets must be at least --sample-every: growth needs two samples")
    sys.stdout.reconfigure(line_buffering=True)
    started = time.monotonic()
    with chaos_cluster() as c:
        print(f"logs in {c.workdir}")
        job, tail = start_job(c, args.setup, args.step_delay)
        soak = Soak(c, tail, args.setup, random.Random(args.seed))
        soak.back_at_full_size(0)
        if has_standbys(args.setup):
            wait_for_standbys(c)
        watched = watched_processes(c, running_pid(c, "host-1"), fork_server=not args.setup.startswith("spawn"))
        for series in watched:
            series.sample(0)
        done = 0
        try:
            for done in range(1, args.resets + 1):
                soak.reset(FAULTS[(done - 1) % len(FAULTS)])
                if done % args.sample_every == 0:
                    for series in watched:
                        series.sample(done)
                    print(f"reset {done}/{args.resets}: round {c.job()['round']}, {time.monotonic() - started:.0f} s")
        except (AssertionError, OSError) as exc:
            print(f"SOAK failed at reset {done}: {exc} (logs in {c.workdir})")
            raise SystemExit(1) from None
        for event in tail.poll():
            soak.keep(event)
        rounds = c.job()["round"]
        c.call("registry", "cancel", {"reason": "soak done"})
        c.wait_job_end(job, 30)
    print("per process: first -> last sample (growth per reset: least-squares slope, (last - first) / resets)")
    for series in watched:
        print(series.report())
    print(
        "reset time, fault -> back at full size (median, max s): "
        + ", ".join(
            f"{fault} {statistics.median(times):.1f}, {max(times):.1f}"
            for fault, times in soak.durations.items()
            if times
        )
    )
    lost = committed_step_lost(soak.marks)
    survivor = watched[0]
    growth = {key: survivor.per_reset(key)[0] for key in USAGE}
    final_commit = max((step for _, event, step, _ in soak.marks if event == "commit"), default=0)
    if lost:
        print(f"committed step lost: {lost}")
    print(
        f"SOAK resets={args.resets} setup={args.setup} rounds={rounds} "
        f"committed_step_lost={'yes' if lost else 'no'} final_committed_step={final_commit} "
        f"survivor_fds_per_reset={growth['fds']:.3f} survivor_threads_per_reset={growth['threads']:.3f} "
        f"survivor_rss_kb_per_reset={growth['rss_kb']:.1f} "
        f"elapsed_s={time.monotonic() - started:.0f}"
    )


if __name__ == "__main__":
    main()
