"""What losing a whole control host costs a training job, over many losses in a row (issue 33).

A 3-host job (3 agents x 1 slot) on a replicated control plane: 3 control hosts on 127.0.0.1-3, each with an etcd
member and one replica of each service (testing/control_hosts.py). Each loss: the control host holding the most
active replicas (ties: etcd's leader) is lost outright (SIGKILL of its replicas and its etcd member, its data
directory deleted); once every service answers from another host, it is replaced (a new member with an empty data
directory, new replicas as standbys); then a worker is SIGKILLed (on each host in turn). Before the first loss,
`--faults` worker SIGKILLs with nothing lost are the baseline, and as many on the same job with the single-host
SQLite control plane compare the stores (a `STORE` line).

Per loss it prints, and at the end the worst and the median of:
- `takeover_s` per service: the loss -> that service answers from another replica;
- `max_pause_s`: the longest time between two commits of rank 0 from the loss to the worker kill;
- `resets`: resets between the loss and the worker kill (0: the loss cost none);
- `lost`: acknowledged decisions lost: the job's (round, resets) going back across the loss;
- `event_problems` (so far): notifier events missed, repeated, or under another incarnation, as a subscriber that
  followed the events through every loss saw them;
- `recovery_s`: worker SIGKILL -> the job back at full size, training (the survivors' first commit in the new
  round with every rank), and its ratio to the baseline's.

    python -m bench.control_plane_ha [--losses 50] [--lease-ttl 1] [--tls]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import zmq

from elastic_control_plane.bus.client import incarnation_id
from elastic_control_plane.bus.pubsub import Subscription
from elastic_control_plane.bus.roles import AGENT
from elastic_control_plane.bus.sockets import Security, generate_keys
from testing.control_hosts import ReplicatedCluster
from testing.etcd_cluster import EtcdCluster
from testing.harness import SERVICES, Cluster, wait_for, worker_pid

HOSTS = ("host-1", "host-2", "host-3")
JOB = [sys.executable, "tests/workers/counter.py", "--batches", "10000000", "--step-delay", "0.02"]


class EventWitness:
    """Follows the notifier's events through every loss (a subscriber like an agent) and counts what went wrong:
    a number missed or repeated, an incarnation changed."""

    def __init__(self, cluster: ReplicatedCluster, keys: Path | None = None) -> None:
        self.ctx = zmq.Context()
        self.subscription = Subscription(
            self.ctx,
            cluster.endpoints.events,
            cluster.endpoints.notifier,
            incarnation_id("bench-witness"),
            security=Security(keys_dir=keys, role=AGENT),
        )
        self.subscription.start()
        self.incarnation = self.subscription.incarnation
        self.seqs: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            if self.subscription.sock.poll(100):
                self.seqs += [int(m.body["seq"]) for m in self.subscription.receive()]

    def problems(self) -> int:
        repeated = len(self.seqs) - len(set(self.seqs))
        missed = sum(b - a - 1 for a, b in zip(self.seqs, self.seqs[1:]) if b > a + 1)
        return repeated + missed + (self.subscription.incarnation != self.incarnation)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.subscription.close()
        self.ctx.term()


def busiest(cluster: ReplicatedCluster) -> str:
    actives = cluster.actives()
    leader = cluster.control_hosts[cluster.etcd.leader_index()]
    return max(cluster.control_hosts, key=lambda h: (sum(a == h for a in actives.values()), h == leader))


def takeover_times(cluster: ReplicatedCluster, lost: str, since: float) -> dict[str, float]:
    """Seconds from `since` until each service answers from a replica on another host than `lost`."""
    took: dict[str, float] = {}

    def all_answered() -> bool:
        for service in SERVICES:
            if service in took:
                continue
            try:
                if cluster.active(service) not in (None, lost) and cluster.call(service, "ping", timeout=0.3):
                    took[service] = time.monotonic() - since
            except Exception:  # not answering yet
                pass
        return len(took) == len(SERVICES)

    wait_for(all_answered, 60, "every service to answer from another replica", interval=0.01)
    return took


class CommitTail:
    """The job's commit events, read as its logs grow (each rank's JSON lines, about 50 a second): reading them whole
    at every poll would cost more with every minute of the run."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._offsets: dict[Path, int] = {}
        self._events: list[dict[str, Any]] = []

    def __call__(self) -> list[dict[str, Any]]:
        fresh = []
        for path in sorted(self.log_dir.glob("*.jsonl")):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            whole = data[: data.rfind(b"\n") + 1]  # a line still being written waits for the next read
            self._offsets[path] = self._offsets.get(path, 0) + len(whole)
            for line in whole.splitlines():
                try:
                    event = json.loads(line)
                except ValueError:  # a line cut short by a kill
                    continue
                if event.get("event") == "commit":
                    fresh.append(event)
        if fresh:
            self._events = sorted(self._events + fresh, key=lambda e: e["time"])
        return self._events


def recover_from_a_worker_kill(cluster: Cluster, commits: CommitTail, host: str) -> float:
    """SIGKILL of `host`'s worker; seconds until every rank has committed in the new round."""
    before = cluster.job()
    victim = worker_pid(cluster, host, 0)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)

    def full_size() -> float | None:
        fresh = [e for e in commits() if e["time"] > killed_at and e["round"] > before["round"]]
        ranks = {e["rank"] for e in fresh}
        return max(e["time"] for e in fresh) if len(ranks) == len(HOSTS) else None

    return wait_for(full_size, 120, "every rank committing in the new round") - killed_at


def worker_faults(cluster: Cluster, commits: CommitTail, faults: int) -> list[float]:
    """The 3-host job started on `cluster`; the recovery time of `faults` worker SIGKILLs, one host after another."""
    for host in HOSTS:
        cluster.start_agent(host, 1)
    # Workers are killed far more often than --max-restarts allows in a real job: the crash-loop policy is not what
    # is measured here.
    cluster.submit("--min-np", "2", "--max-restarts", "100000", "--", *JOB, "--log-dir", str(commits.log_dir))
    wait_for(lambda: len(commits()) >= 100 and cluster.job()["state"] == "running", 120, "training")
    return [recover_from_a_worker_kill(cluster, commits, HOSTS[n % len(HOSTS)]) for n in range(faults)]


def lose_one(cluster: ReplicatedCluster, commits: CommitTail, witness: EventWitness, victim: str) -> dict[str, Any]:
    before = cluster.job()
    lost = busiest(cluster)
    lost_at_wall, lost_at = time.time(), time.monotonic()
    cluster.kill_control_host(lost)
    took = takeover_times(cluster, lost, lost_at)
    cluster.replace_control_host(lost)
    wait_for(lambda: commits()[-1]["time"] > time.time() - 0.5, 60, "steady training")
    after = cluster.job()
    lost_decisions = int((after["round"], after["resets"]) < (before["round"], before["resets"]))
    worker_killed_at = time.time()
    recovery = recover_from_a_worker_kill(cluster, commits, victim)
    times = sorted(e["time"] for e in commits() if e["rank"] == 0 and lost_at_wall - 1 <= e["time"] <= worker_killed_at)
    return {
        "host": lost,
        "takeover_s": took,
        "max_pause_s": max(b - a for a, b in zip(times, times[1:])),
        "resets": after["resets"] - before["resets"],
        "lost": lost_decisions,
        "event_problems": witness.problems(),
        "recovery_s": recovery,
    }


def summarize(results: list[dict[str, Any]], witness: EventWitness, baseline: float) -> None:
    worst_takeover = max(max(r["takeover_s"].values()) for r in results)
    median_takeover = statistics.median(max(r["takeover_s"].values()) for r in results)
    print(
        f"HA losses={len(results)} takeover_s(all services) median={median_takeover:.2f} max={worst_takeover:.2f} "
        f"max_pause_s={max(r['max_pause_s'] for r in results):.3f} resets={sum(r['resets'] for r in results)} "
        f"lost={sum(r['lost'] for r in results)} event_problems={witness.problems()} "
        f"recovery_s median={statistics.median(r['recovery_s'] for r in results):.2f} "
        f"max={max(r['recovery_s'] for r in results):.2f} baseline={baseline:.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", type=int, default=50, help="Control hosts lost (and replaced) in a row.")
    parser.add_argument("--keep-logs", action="store_true", help="Keep the processes' logs (printed where).")
    parser.add_argument(
        "--faults", type=int, default=9, help="Worker SIGKILLs with each store before the losses (the baseline)."
    )
    parser.add_argument(
        "--lease-ttl", type=int, default=None, help="The replicas' lease in seconds (ELASTIC_LEASE_TTL; default 1)."
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="etcd over mutual TLS and CURVE keys on every socket (both stores' runs), as a secure deployment runs.",
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="elastic-bench-ha-"))
    etcd = EtcdCluster(workdir / "etcd", tls=args.tls)
    keys = etcd.keys_dir if args.tls else None
    if keys is not None:  # beside etcd's certificates: the services then speak TLS to etcd
        generate_keys(keys)
    secure = {"ELASTIC_KEYS": str(keys)} if keys is not None else {}
    cluster: ReplicatedCluster | None = None
    witness: EventWitness | None = None
    finished = False
    try:
        etcd.start()
        lease = {"ELASTIC_LEASE_TTL": str(args.lease_ttl)} if args.lease_ttl else {}
        cluster = ReplicatedCluster(workdir / "cluster", etcd, {**lease, **secure})
        sqlite = Cluster(workdir / "sqlite", secure)
        try:
            sqlite.start_services()
            sqlite_faults = worker_faults(sqlite, CommitTail(workdir / "sqlite-train"), args.faults)
        finally:
            sqlite.close()
        cluster.start_services()
        commits = CommitTail(workdir / "train")
        etcd_faults = worker_faults(cluster, commits, args.faults)
        witness = EventWitness(cluster, keys)
        baseline = statistics.median(etcd_faults)
        print(
            f"STORE worker fault, {args.faults} each: recovery_s median sqlite={statistics.median(sqlite_faults):.3f} "
            f"etcd={baseline:.3f} etcd/sqlite x{baseline / statistics.median(sqlite_faults):.2f}",
            flush=True,
        )
        results = []
        for number in range(1, args.losses + 1):
            result = lose_one(cluster, commits, witness, HOSTS[number % len(HOSTS)])
            results.append(result)
            takeovers = " ".join(f"{s}={t:.2f}" for s, t in sorted(result["takeover_s"].items()))
            print(
                f"loss {number:>3} of {result['host']}: takeover_s {takeovers} max_pause_s={result['max_pause_s']:.3f} "
                f"resets={result['resets']} lost={result['lost']} event_problems={result['event_problems']} "
                f"recovery_s={result['recovery_s']:.2f} ratio={result['recovery_s'] / baseline:.2f}",
                flush=True,
            )
        if results:
            summarize(results, witness, baseline)
        finished = True
    finally:
        if witness is not None:
            witness.close()
        if cluster is not None:
            cluster.close()
        etcd.stop()
        if finished and not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"(logs are kept in {workdir})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
