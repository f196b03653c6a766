"""What the collective probe costs a host's entry: the same cluster and job without and with `--collective-probe`,
in one run.

    python -m bench.collective_probe [--repeats 5]

Production heartbeats (1 s). Three agents of one slot start; measured:
  start      the last agent registered -> all three available (with the probe: their probe processes start,
             the three are probed together)
  re-entry   a running job at size 3: host-3 drained, then (once the job trains at size 2) undrained -> host-3
             available again, and -> the job's first step at size 3 (with the probe: host-3 is probed alone,
             the two hosts in the job are not)
and, from discovery's log, each probe's own time (`collective_probe_judged` took_s: asked -> judged).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from bench.common import JOB, cluster, first_step_after
from testing.harness import Cluster, wait_for

HOSTS = ("host-1", "host-2", "host-3")


def available(c: Cluster) -> set[str]:
    return {name for name, _ in c.call("discovery", "hosts")["available"]}


def probe_times(c: Cluster) -> list[tuple[int, float]]:
    judged = []
    for line in c.output("discovery").splitlines():
        if line.startswith("{") and (record := json.loads(line)).get("event") == "collective_probe_judged":
            judged.append((len(record["seconds"]), record["took_s"]))
    return judged


def measure(probe: bool, repeats: int) -> dict[str, Any]:
    env = {"ELASTIC_HEARTBEAT": "1.0", **({"ELASTIC_COLLECTIVE_PROBE": "1"} if probe else {})}
    with cluster(env) as c:
        for host in HOSTS:
            c.start_agent(host, 1)
        registered = time.time()
        wait_for(lambda: available(c) == set(HOSTS), 120, "three hosts available")
        start = time.time() - registered
        log_dir = c.workdir / "train"
        job = c.submit(
            "--min-np", "2", "--", *JOB, "--epochs", "1000", "--step-delay", "0.02", "--log-dir", str(log_dir)
        )
        first_step_after(log_dir, 0, size=3)
        available_again, training_again = [], []
        for _ in range(repeats):
            c.elasticctl("drain", "host-3")
            first_step_after(log_dir, time.time(), size=2)
            undrained = time.time()
            c.elasticctl("undrain", "host-3")
            wait_for(lambda: "host-3" in available(c), 60, "host-3 available again", interval=0.01)
            available_again.append(time.time() - undrained)
            training_again.append(first_step_after(log_dir, undrained, size=3)["time"] - undrained)
        c.call("registry", "cancel", {"reason": "benchmark done"})
        c.wait_job_end(job, 30)
        return {"start": start, "available": available_again, "training": training_again, "probes": probe_times(c)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    without, with_probe = measure(False, args.repeats), measure(True, args.repeats)
    print("\n| | without the probe | with the probe | difference |\n| --- | --- | --- | --- |")
    print(
        f"| start: last agent registered -> 3 hosts available | {without['start']:.2f} s | {with_probe['start']:.2f} s "
        f"| {with_probe['start'] - without['start']:+.2f} s |"
    )
    for key, title in (("available", "undrain -> host-3 available"), ("training", "undrain -> first step at size 3")):
        a, b = statistics.median(without[key]), statistics.median(with_probe[key])
        print(f"| {title} (median of {args.repeats}) | {a:.2f} s | {b:.2f} s | {b - a:+.2f} s |")
    print(
        "\nprobes (hosts probed, asked -> judged):",
        ", ".join(f"{n} host(s) {s:.2f} s" for n, s in with_probe["probes"]),
    )


if __name__ == "__main__":
    main()
