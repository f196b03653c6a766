"""A worker starts in tens of milliseconds (issue 23): the paths that need a new worker, forked against spawned.

    python -m bench.fork_server [--repeats 3] [--only kill,resume,join,undrain,memory]

Each scenario runs twice in one invocation, on clusters of their own: with the
fork server (the default) and with `--no-fork-server` (every worker a fresh
interpreter: the reference). Agents run with `--standby 0`, so every path
below starts a process. Job: `examples/train_elastic.py` (commit every 4
steps, `--step-delay 0.02`), `--max-restarts 100 --restart-window 1
--blacklist-cooldown 0 0`: every kill is a slot's first crash in its window
(restarted at once) and no host stays out.

  kill     3 hosts x 1 slot; host-3's worker SIGKILLed `--repeats` times:
           kill -> the first step at world size 3 by its replacement
  resume   2 hosts x 1 slot; both workers SIGKILLed at once `--repeats` times:
           kill -> the first step of the resumed job (new processes)
  join     2 hosts x 1 slot train; host-3's agent is started `--repeats`
           times (stopped again in between): agent start -> host-3 trains in
           the job (its first step at size 3), and its registration -> that step
  undrain  3 hosts x 1 slot; host-3 drained until the job is at size 2, then
           undrained: undrain -> host-3's first step at size 3
  memory   2 hosts x 1 slot, one standby each (with the fork server: the
           agents' default; spawning: `--standby 1`): RSS, PSS and USS
           (/proc/PID/smaps_rollup; USS, its private pages, is what one more
           such process costs) of host-1's zygote, standby and worker

Printed per scenario and mode: median, max and samples; then one line
`FORK_SERVER kill_s=... resume_s=... join_s=... undrain_s=...` (medians with
the fork server) `vs_spawn=...` (the same medians without, in this run).
Every process started here is stopped on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import JOB, cluster, log_time, steps
from testing.harness import Cluster, wait_for

JOB_OPTIONS = ["--max-restarts", "100", "--restart-window", "1", "--blacklist-cooldown", "0", "0"]
TRAIN = ["--epochs", "1000", "--step-delay", "0.02"]
MODES = {"fork server": [], "spawn": ["--no-fork-server"]}


@contextlib.contextmanager
def _training(
    hosts: int, mode: list[str], agent_args: tuple[str, ...] = ("--standby", "0")
) -> Iterator[tuple[Cluster, Path]]:
    """A cluster of `hosts` agents with one slot each, training the job until it is steady at full size."""
    with cluster() as c:
        for number in range(1, hosts + 1):
            c.start_agent(f"host-{number}", 1, list(agent_args))
        log_dir = c.workdir / "train"
        c.submit("--min-np", "2", *JOB_OPTIONS, *mode, "--", *JOB, *TRAIN, "--log-dir", str(log_dir))
        _settle(log_dir, hosts, 0.0)
        yield c, log_dir


def _first_step(log_dir: Path, after: float, what: str, match: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    return wait_for(
        lambda: next((e for e in steps(log_dir) if e["time"] > after and match(e)), None), 120, what, interval=0.02
    )


def _worker(c: Cluster, host: str) -> int:
    def find() -> int | None:
        return next(
            (
                int(w["pid"])
                for w in c.call("registry", "status")["workers"]
                if w["host"] == host and w["state"] == "RUNNING"
            ),
            None,
        )

    return wait_for(find, 60, f"{host}'s running worker")


def _settle(log_dir: Path, size: int, after: float) -> None:
    """Wait for 20 steps of rank 0 at `size` after `after` (the job is steady again)."""
    wait_for(
        lambda: sum(e["rank"] == 0 and e["size"] == size and e["time"] > after for e in steps(log_dir)) >= 20,
        120,
        f"steady at size {size}",
    )


def kill(mode: list[str], repeats: int) -> list[float]:
    samples = []
    with _training(3, mode) as (c, log_dir):
        for _ in range(repeats):
            victim = _worker(c, "host-3")
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            back = _first_step(
                log_dir,
                killed,
                "host-3's replacement training at size 3",
                lambda e: e["size"] == 3 and e["host"] == "host-3" and e["pid"] != victim,
            )
            samples.append(back["time"] - killed)
            _settle(log_dir, 3, back["time"])
    return samples


def resume(mode: list[str], repeats: int) -> list[float]:
    samples = []
    with _training(2, mode) as (c, log_dir):
        for _ in range(repeats):
            old = {_worker(c, "host-1"), _worker(c, "host-2")}
            killed = time.time()
            for pid in old:
                os.kill(pid, signal.SIGKILL)
            back = _first_step(log_dir, killed, "the resumed job's first step", lambda e: e["pid"] not in old)
            samples.append(back["time"] - killed)
            _settle(log_dir, 2, back["time"])
    return samples


def join(mode: list[str], repeats: int) -> tuple[list[float], list[float]]:
    from_start, from_registration = [], []
    with _training(2, mode) as (c, log_dir):
        for _ in range(repeats):
            started = time.time()
            c.start_agent("host-3", 1, ["--standby", "0"])
            joined = _first_step(
                log_dir, started, "host-3 training in the job", lambda e: e["host"] == "host-3" and e["size"] == 3
            )
            registered = log_time(c, "discovery", "host_registered", started) or float("nan")
            from_start.append(joined["time"] - started)
            from_registration.append(joined["time"] - registered)
            c.stop("agent-host-3")
            _settle(log_dir, 2, time.time())
    return from_start, from_registration


def undrain(mode: list[str], repeats: int) -> list[float]:
    samples = []
    with _training(3, mode) as (c, log_dir):
        for _ in range(repeats):
            drained = time.time()
            c.elasticctl("drain", "host-3")
            _first_step(log_dir, drained, "the job at size 2", lambda e: e["size"] == 2)
            wait_for(
                lambda: not any(w["host"] == "host-3" for w in c.call("registry", "status")["workers"]),
                60,
                "host-3's worker gone",
            )
            undrained = time.time()
            c.elasticctl("undrain", "host-3")
            back = _first_step(
                log_dir, undrained, "host-3 training again", lambda e: e["host"] == "host-3" and e["size"] == 3
            )
            samples.append(back["time"] - undrained)
            _settle(log_dir, 3, back["time"])
    return samples


def _memory_of(pid: int) -> tuple[float, float, float]:
    """RSS, PSS and USS (its private pages: what one more such process costs) of a process, MiB."""
    values = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("Rss", "Pss", "Private_Clean", "Private_Dirty"):
            values[name] = int(rest.split()[0]) / 1024
    return values["Rss"], values["Pss"], values["Private_Clean"] + values["Private_Dirty"]


def _agent_events(c: Cluster, host: str, event: str) -> list[dict[str, Any]]:
    found = []
    for line in c.output(f"agent-{host}").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                found.append(record)
    return found


def memory(mode: list[str]) -> dict[str, tuple[float, float, float]]:
    """RSS and PSS of host-1's processes: with the fork server, the agents' defaults (its one standby); spawning,
    `--standby 1`."""
    with _training(2, mode, agent_args=("--standby", "1") if mode else ()) as (c, _):
        standby = wait_for(lambda: _agent_events(c, "host-1", "standby_waiting"), 60, "host-1's standby waiting")[-1][
            "pid"
        ]
        found = {"standby": _memory_of(standby), "worker": _memory_of(_worker(c, "host-1"))}
        if not mode:
            found["zygote"] = _memory_of(_agent_events(c, "host-1", "fork_server_starting")[-1]["pid"])
        return found


def _line(name: str, values: list[float]) -> str:
    return (
        f"  {name:<44} median {statistics.median(values):6.3f} s  max {max(values):6.3f} s  samples "
        f"{', '.join(f'{v:.3f}' for v in values)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="kill,resume,join,undrain,memory", help="Scenarios to run, comma-separated.")
    args = parser.parse_args()
    chosen = args.only.split(",")
    medians: dict[str, dict[str, float]] = {mode: {} for mode in MODES}
    for scenario, title in (
        ("kill", "worker SIGKILL -> full size (no standby)"),
        ("resume", "whole-job resume (no standby)"),
        ("join", "a host joins the running job"),
        ("undrain", "undrain -> full size"),
    ):
        if scenario not in chosen:
            continue
        print(f"\n{title}", flush=True)
        for mode, options in MODES.items():
            if scenario == "join":
                from_start, from_registration = join(options, args.repeats)
                print(_line(f"{mode}: agent start -> host trains", from_start))
                print(_line(f"{mode}: agent registered -> host trains", from_registration), flush=True)
                medians[mode][scenario] = statistics.median(from_start)
            else:
                samples = {"kill": kill, "resume": resume, "undrain": undrain}[scenario](options, args.repeats)
                print(_line(mode, samples), flush=True)
                medians[mode][scenario] = statistics.median(samples)
    if "memory" in chosen:
        print("\nmemory of host-1's processes (2 hosts x 1 slot, one standby each), MiB")
        for mode, options in MODES.items():
            for name, (rss, pss, uss) in memory(options).items():
                print(f"  {mode + ': ' + name:<22} RSS {rss:7.1f}  PSS {pss:7.1f}  USS {uss:7.1f}", flush=True)
    forked, spawned = medians["fork server"], medians["spawn"]
    if not forked:
        return
    print(
        "\nFORK_SERVER "
        + " ".join(f"{name}_s={value:.3f}" for name, value in forked.items())
        + " vs_spawn="
        + ",".join(f"{name}:{spawned[name]:.3f}" for name in forked),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
