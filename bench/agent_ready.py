"""A host whose agent is ready before the job: how soon its workers train (issue 31).

    python -m bench.agent_ready [--runs 3] [--wait 30]

Every run has a cluster of its own (the four real services), the job `examples/train_elastic.py` (`--step-delay
0.02`), hosts of one slot, the agents' defaults (the fork server: each agent readies a zygote for its own
interpreter when it starts). Three ways a host comes to train, each timed to the host's first step:
  ready-job    2 agents started `--wait` seconds before the job is submitted: from `elasticctl run` to the
               first step at size 2 (the slower host's), i.e. admitted -> training, plus the round's forming;
  cold-job     the same 2 agents started together with the job: from the agents' start to the first step at
               size 2 (agent process started -> training: each agent's zygote imports torch on the way);
  ready-join   a job trains on 2 hosts listed by a discovery script; host-3's agent is started unlisted and,
               `--wait` seconds later, listed: from the listing to host-3's first step (admitted -> training
               for a host joining a running job).

Printed: `READY variant=V run=I seconds=S` per measurement, then `READY_SUMMARY variant=V median_s=M max_s=X` and
`READY_RATIO cold-job/ready-job=R`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.common import JOB, cluster, steps
from elastic_control_plane.elasticctl.local_processes import agent_argv
from testing.harness import Cluster, wait_for

TRAIN = ["--epochs", "100000", "--step-delay", "0.02"]


def first_step_at_size(log_dir: Path, size: int, after: float, host: str | None = None) -> float:
    def found() -> float | None:
        times = [
            e["time"] for e in steps(log_dir) if e["size"] == size and e["time"] > after and host in (None, e["host"])
        ]
        return min(times) if times else None

    return wait_for(found, 180, f"a step at size {size}" + (f" on {host}" if host else ""))


def all_ready(c: Cluster, hosts: list[str]) -> bool:
    states = {h["host"]: (h.get("fork_server") or {}).get("state") for h in c.call("discovery", "hosts")["all"]}
    return all(states.get(host) == "ready" for host in hosts)


def ready_job(wait: float) -> float:
    with cluster() as c:
        for host in ("host-1", "host-2"):
            c.start_agent(host, 1)
        wait_for(lambda: all_ready(c, ["host-1", "host-2"]), 120, "both agents' fork servers ready")
        time.sleep(wait)  # the scenario itself: agents that have waited this long for a job
        log_dir = c.workdir / "log"
        submitted = time.time()
        c.submit("--min-np", "2", "--", *JOB, *TRAIN, "--log-dir", str(log_dir))
        return first_step_at_size(log_dir, 2, submitted) - submitted


def cold_job() -> float:
    with cluster() as c:
        log_dir = c.workdir / "log"
        started = time.time()
        for host in ("host-1", "host-2"):
            c.spawn(
                f"agent-{host}",
                agent_argv(host, 1),
            )
        c.submit("--min-np", "2", "--", *JOB, *TRAIN, "--log-dir", str(log_dir))
        return first_step_at_size(log_dir, 2, started) - started


def ready_join(wait: float) -> float:
    with cluster() as c:
        listing = c.workdir / "hosts.txt"
        listing.write_text("host-1:1\nhost-2:1\n")
        script = c.workdir / "discover.sh"
        script.write_text(f"#!/bin/sh\ncat {listing}\n")
        script.chmod(0o755)
        for host in ("host-1", "host-2"):
            c.start_agent(host, 1)
        log_dir = c.workdir / "log"
        c.submit(
            "--min-np",
            "2",
            "--max-np",
            "3",
            "--discovery-script",
            str(script),
            "--",
            *JOB,
            *TRAIN,
            "--log-dir",
            str(log_dir),
        )
        first_step_at_size(log_dir, 2, 0.0)
        c.start_agent("host-3", 1)
        wait_for(lambda: all_ready(c, ["host-3"]), 120, "host-3's fork server ready")
        time.sleep(wait)
        listed = time.time()
        listing.write_text("host-1:1\nhost-2:1\nhost-3:1\n")
        return first_step_at_size(log_dir, 3, listed, host="host-3") - listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--wait", type=float, default=30.0, help="Seconds a ready agent waits before its host is admitted."
    )
    args = parser.parse_args()
    found: dict[str, list[float]] = {"ready-job": [], "cold-job": [], "ready-join": []}
    for run in range(1, args.runs + 1):
        for variant, measure in (
            ("ready-job", lambda: ready_job(args.wait)),
            ("cold-job", cold_job),
            ("ready-join", lambda: ready_join(args.wait)),
        ):
            seconds = measure()
            found[variant].append(seconds)
            print(f"READY variant={variant} run={run} seconds={seconds:.3f}", flush=True)
    for variant, values in found.items():
        print(
            f"READY_SUMMARY variant={variant} median_s={statistics.median(values):.3f} max_s={max(values):.3f}",
            flush=True,
        )
    print(
        "READY_RATIO "
        f"cold-job/ready-job={statistics.median(found['cold-job']) / statistics.median(found['ready-job']):.1f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
