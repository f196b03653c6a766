"""A hung host (its agent stopped with SIGSTOP): time to declare it lost and to the first step without it.

    python -m bench.lost_host [--repeats 5]

Production intervals: heartbeat 1 s, lost after 3 missed. Each repeat stops
host-2's agent, measures from the stop
  lost       -> discovery declares host-2 lost (expected ~3 heartbeats)
  first step -> the first step completed at world size 2 (the registry's abort
                released the survivors' blocked collectives at once)
then resumes the agent and waits for host-2 to rejoin after its cooldown.
"""

from __future__ import annotations

import argparse
import signal
import time

from bench.common import JOB, cluster, first_step_after, log_time, report, steady_step_seconds, warm_up


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    parts: dict[str, list[float]] = {"lost (stop -> host declared lost)": [], "first step without the host": []}
    with cluster({"ELASTIC_HEARTBEAT": "1.0", "ELASTIC_MISSED_HEARTBEATS": "3"}) as c:
        c.start_agent("host-1", 2)
        c.start_agent("host-2", 2)
        log_dir = c.workdir / "train"
        job = c.submit(
            "--min-np",
            "2",
            "--blacklist-cooldown",
            "1",
            "1",
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
        agent = c.processes["agent-host-2"]
        for _ in range(args.repeats):
            stopped = time.time()
            agent.send_signal(signal.SIGSTOP)
            step = first_step_after(log_dir, stopped, size=2, timeout=60)
            agent.send_signal(signal.SIGCONT)
            parts["lost (stop -> host declared lost)"].append(
                (log_time(c, "discovery", "host_lost", stopped) or float("nan")) - stopped
            )
            parts["first step without the host"].append(step["time"] - stopped)
            first_step_after(log_dir, time.time(), size=4, timeout=120)
        baseline = steady_step_seconds(log_dir)
        c.call("registry", "cancel", {"reason": "benchmark done"})
        c.wait_job_end(job, 30)
    report("hung host (agent SIGSTOP), heartbeat 1 s x 3", parts, baseline)


if __name__ == "__main__":
    main()
