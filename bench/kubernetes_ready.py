"""How soon a Ready pod is in the job (issue 34's goal: in the job's next round within 1 s of the event).

Discovery watches the agents' pods in a loopback Kubernetes API server (testing/kube_apiserver.py) that speaks the
real protocol; the job starts on one pod. Each sample adds a pod whose agent registers and warms up (its workers
wait in init, as they do when a host joins a running job) while the pod is not Ready yet; then the pod is made Ready
and the bench measures, from that event:
- `available_s`: discovery lists the host as available;
- `round_s`: the registry's job has the pod's slot, in a new round (the next round, released).

    python -m bench.kubernetes_ready [--pods 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.common import cluster
from testing.harness import Cluster, wait_for
from testing.kube_apiserver import KubeApiServer

LABELS = {"app.kubernetes.io/name": "elastic", "app.kubernetes.io/component": "agent"}
SELECTOR = ",".join(f"{k}={v}" for k, v in LABELS.items())
JOB = [sys.executable, "tests/workers/counter.py", "--batches", "100000", "--step-delay", "0.02"]


def host_state(plane: Cluster, host: str) -> str | None:
    return next((h["state"] for h in plane.call("discovery", "hosts")["all"] if h["host"] == host), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=4, help="Pods made Ready one after another while the job runs.")
    args = parser.parse_args()
    api = KubeApiServer()
    env = {"ELASTIC_KUBERNETES_API": api.url, "ELASTIC_KUBERNETES_SELECTOR": SELECTOR}
    try:
        with cluster(env) as plane:
            api.add_pod("pod-0", LABELS)
            plane.start_agent("pod-0", 1)
            api.set_ready("pod-0", True)
            plane.submit("--min-np", "1", "--", *JOB, "--log-dir", str(plane.workdir / "train"))
            wait_for(lambda: plane.job()["state"] == "running" and plane.job()["size"] == 1, 120, "the job")
            available, rounds = [], []
            for number in range(1, args.pods + 1):
                pod = f"pod-{number}"
                api.add_pod(pod, LABELS)
                plane.start_agent(pod, 1)
                wait_for(lambda p=pod: host_state(plane, p) == "unlisted", 60, f"{pod}'s agent warm, not listed")
                before = plane.job()["round"]
                made_ready = time.monotonic()
                api.set_ready(pod, True)
                seen = wait_for(
                    lambda p=pod: (
                        p in {h for h, _ in plane.call("discovery", "hosts")["available"]} and time.monotonic()
                    ),
                    10,
                    f"{pod} available",
                    interval=0.005,
                )
                in_round = wait_for(
                    lambda n=number, b=before: (
                        (j := plane.job())["size"] == n + 1
                        and j["round"] > b
                        and j["state"] == "running"
                        and time.monotonic()
                    ),
                    60,
                    f"{pod} in the job's next round",
                    interval=0.01,
                )
                available.append(seen - made_ready)
                rounds.append(in_round - made_ready)
                print(f"{pod}: available_s={available[-1]:.3f} round_s={rounds[-1]:.3f}", flush=True)
            print(
                f"KUBERNETES_READY pods={args.pods} available_s median={statistics.median(available):.3f} "
                f"max={max(available):.3f} round_s median={statistics.median(rounds):.3f} max={max(rounds):.3f}",
                flush=True,
            )
            plane.call("registry", "cancel", {"reason": "benchmark done"})
    finally:
        api.close()


if __name__ == "__main__":
    main()
