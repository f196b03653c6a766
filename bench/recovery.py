"""Recovery from `kill -9` of a worker (issue 4): time to the first completed step after recovery, and its parts.

    python -m bench.recovery [--repeats 5]

One job on host-1 and host-2 (2 slots each); each repeat kills one worker of
host-2 with SIGKILL and measures, from the kill:
  detection  -> the registry records the failure (agent's SIGCHLD exit report)
  new round  -> the registry starts the next round
  sync       -> the ranks of the new round enter training with synced state
  first step -> the first step completed after recovery

`--cooldown 0` lets host-2 straight back, so the next round waits for a
respawned worker (process start + torch import); the default cooldown
blacklists host-2 for a few seconds, so training resumes at once on host-1
(Horovod's behaviour) and host-2 rejoins after the cooldown.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

from bench.common import JOB, cluster, first_step_after, log_time, report, steady_step_seconds, warm_up
from testing.harness import read_events, wait_for


def _running_pid(c, host: str, local_rank: int) -> int:  # type: ignore[no-untyped-def]
    def find() -> int | None:
        for w in c.call("registry", "status")["workers"]:
            if (w["host"], w["local_rank"], w["state"]) == (host, local_rank, "RUNNING"):
                return int(w["pid"])
        return None

    return wait_for(find, 60, "a running worker on host-2")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cooldown", type=float, default=3.0, help="Blacklist cooldown of the failed host, seconds.")
    args = parser.parse_args()
    parts: dict[str, list[float]] = {
        "detection (kill -> failure recorded)": [],
        "new round (kill -> round started)": [],
        "sync (kill -> ranks entered)": [],
        "first step after recovery": [],
    }
    with cluster() as c:
        c.start_agent("host-1", 2)
        c.start_agent("host-2", 2)
        log_dir = c.workdir / "train"
        job = c.submit(
            "--min-np",
            "2",
            "--blacklist-cooldown",
            str(args.cooldown),
            str(args.cooldown),
            "--",
            *JOB,
            "--epochs",
            "1000",
            "--samples",
            "4096",
            "--log-dir",
            str(log_dir),
        )
        warm_up(log_dir)
        for repeat in range(args.repeats):
            pid = _running_pid(c, "host-2", repeat % 2)
            round_before = c.call("registry", "job")["round"]
            killed = time.time()
            os.kill(pid, signal.SIGKILL)
            step = first_step_after(log_dir, killed, timeout=120)
            while step["round"] <= round_before:
                step = first_step_after(log_dir, step["time"], timeout=120)
            entered = min(
                e["time"] for e in read_events(log_dir) if e["event"] == "enter" and e["round"] == step["round"]
            )
            parts["detection (kill -> failure recorded)"].append(
                (log_time(c, "registry", "worker_failed", killed) or float("nan")) - killed
            )
            parts["new round (kill -> round started)"].append(
                (log_time(c, "registry", "round_started", killed) or float("nan")) - killed
            )
            parts["sync (kill -> ranks entered)"].append(entered - killed)
            parts["first step after recovery"].append(step["time"] - killed)
            while c.call("registry", "job")["size"] != 4 or not any(
                w["state"] == "RUNNING" for w in c.call("registry", "status")["workers"] if w["host"] == "host-2"
            ):
                first_step_after(log_dir, time.time(), timeout=120)
        baseline = steady_step_seconds(log_dir)
        c.call("registry", "cancel", {"reason": "benchmark done"})
        c.wait_job_end(job, 30)
    report(
        f"recovery from kill -9 of one worker (2 hosts x 2 slots, blacklist cooldown {args.cooldown:g} s)",
        parts,
        baseline,
    )


if __name__ == "__main__":
    main()
