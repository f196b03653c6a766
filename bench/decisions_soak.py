"""Are decisions and exit reports delivered exactly once while etcd stalls and refuses?

A 3-host job (3 agents x 1 slot) on a replicated control plane: 3 control hosts on 127.0.0.1-3, each with an etcd
member (a small `--quota-backend-bytes`) and one replica of each service (testing/control_hosts.py). Each cycle
SIGKILLs a worker (on each host in turn) and injects one fault, each kind once per four cycles (in an order drawn
from `--seed`):
- `leader_stop`: etcd's leader SIGSTOPped for 2 s while the round after the kill forms;
- `two_stop`: the leader and another member SIGSTOPped for 3 s (no quorum) while it forms;
- `quota`: etcd filled to its quota (a junk key rewritten a MiB at a time until it refuses with NOSPACE) before the
  kill, so the exit report's save is refused until the active replica reclaims the space itself;
- `notifier_failover`: the active notifier SIGKILLed while the round forms (and started again as a standby).
Then it waits for every service to answer and the job to train at full size again, and times that from the kill
(issue 56: a save refused at the end of a pass, or rank 0's store address refused, once stalled a round for 81 s):
a recovery slower than `--stall-s` (5 s) is a stall. `--kinds leader_stop` injects only that kind (the issue's
"a worker kill with etcd's leader stopped 2 s right after, 20 times in a row").

What it checks, the heart of it:
- decisions: every event the notifier published (a subscriber following them through every failover, checked
  against the notifier's kept history) reached every agent (each logs `notified` per event) exactly once, in
  order, under one incarnation; the registry's `round` events number its rounds 1, 2, ... up to the job's last,
  each once, and `job_finished` is published once;
- exit reports: each killed worker's exit is in the registry's decision for its round (`rank R on HOST exited with
  code -9`, the round's history entry);
- the job ends with exit 0 and every commit (tests/workers/counter.py's totals, the end set with --batches-file).

    python -m bench.decisions_soak [--faults 200] [--kinds K,...] [--stall-s 5] [--seed 0] [--quota-mib 16]
                                   [--max-minutes M] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.control_plane_ha import HOSTS, CommitTail, EventWitness
from elastic_control_plane.bus.contract import PUBLISH_KEY, Event
from elastic_control_plane.replication.etcd import EtcdClient, EtcdRefused, space_exceeded
from testing.control_hosts import ReplicatedCluster, replica_name
from testing.etcd_cluster import EtcdCluster
from testing.harness import SERVICES, read_events, wait_for

KINDS = ("leader_stop", "two_stop", "quota", "notifier_failover")
JUNK = b"soak-junk/fill"  # outside the control plane's prefix
RECOVERY_S = 180  # generous for a loaded 2-core machine
# Heartbeats slower than the harness's, and replicas' leases of 2 s (not 1): a host declared lost, or a replica
# stepping down, because a loaded machine starved its process is a fault this soak does not mean to inject.
TIMING = {"ELASTIC_HEARTBEAT": "0.5", "ELASTIC_MISSED_HEARTBEATS": "6", "ELASTIC_LEASE_TTL": "2"}
END_MARGIN = 150  # batches between the last fault and the job's end


class DecisionWitness(EventWitness):
    """An EventWitness that keeps every event it was delivered, not only its number."""

    def __init__(self, cluster: ReplicatedCluster) -> None:
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        super().__init__(cluster)

    def _follow(self) -> None:
        while not self._stop.is_set():
            if self.subscription.sock.poll(100):
                for message in self.subscription.receive():
                    self.seqs.append(int(message.body["seq"]))
                    self.events.append((int(message.body["seq"]), message.type, message.body))


def stopped(processes: list[Any], seconds: float) -> None:
    """SIGSTOP `processes` for `seconds` (the fault itself), then SIGCONT, whatever happens."""
    try:
        for process in processes:
            process.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)


def fill_to_quota(client: EtcdClient, quota: int) -> None:
    """Rewrite a junk key a MiB at a time (every version kept until compacted) until etcd refuses for space."""
    for number in range(4 * quota // 2**20):
        try:
            client.put(JUNK, bytes([number % 256]) * 2**20, deadline=30)
        except EtcdRefused as exc:
            if space_exceeded(exc):
                return
            raise
    raise AssertionError("etcd took four times its quota")


def kill_worker(cluster: ReplicatedCluster, host: str) -> dict[str, Any]:
    """SIGKILL of `host`'s worker, found in the registry's status (no elasticctl to start on a loaded machine)."""

    def running() -> dict[str, Any] | None:
        status = cluster.call("registry", "status")
        workers = [w for w in status["workers"] if w["host"] == host and w["state"] == "RUNNING" and w["pid"]]
        return {"host": host, "pid": workers[0]["pid"], "round": status["round"]} if workers else None

    killed = wait_for(running, RECOVERY_S, f"a running worker on {host}")
    os.kill(killed["pid"], signal.SIGKILL)
    return {**killed, "at": time.monotonic()}


def inject(kind: str, cluster: ReplicatedCluster, client: EtcdClient, quota: int, victim: str) -> dict[str, Any]:
    """One cycle: the fault `kind` around a SIGKILL of `victim`'s worker; the kill's record."""
    etcd = cluster.etcd
    if kind == "quota":
        fill_to_quota(client, quota)
        killed = kill_worker(cluster, victim)
        wait_for(lambda: client.put(b"soak-junk/probe", b"x") > 0, RECOVERY_S, "etcd to take writes again")
        client.delete(JUNK)
        return killed
    killed = kill_worker(cluster, victim)
    if kind == "leader_stop":
        stopped([etcd.processes[etcd.leader_index()]], 2.0)
    elif kind == "two_stop":
        leader = etcd.leader_index()
        stopped([etcd.processes[leader], etcd.processes[(leader + 1) % 3]], 3.0)
    else:
        holder = wait_for(lambda: cluster.active("notifier"), RECOVERY_S, "an active notifier")
        cluster.processes[replica_name("notifier", holder)].send_signal(signal.SIGKILL)
        cluster.processes[replica_name("notifier", holder)].wait(timeout=10)
        wait_for(lambda: cluster.active("notifier") not in (None, holder), RECOVERY_S, "another notifier to take over")
        cluster.start_replicas(holder, ("notifier",))
    return killed


def recovered(cluster: ReplicatedCluster, commits: CommitTail, killed: dict[str, Any]) -> bool:
    """Every service answers, and the job trains at full size in a round after the kill."""
    etcd_ok = cluster.etcd.leader_index() >= 0
    job = cluster.job()
    if not (etcd_ok and job["state"] == "running" and job["size"] == len(HOSTS) and job["round"] > killed["round"]):
        return False
    for service in SERVICES:
        cluster.call(service, "ping", timeout=0.5)
    fresh = {e["rank"] for e in commits()[-200:] if e["round"] == job["round"]}
    return len(fresh) == len(HOSTS)


def exit_reported(cluster: ReplicatedCluster, killed: dict[str, Any]) -> bool:
    """Is the killed worker's exit in the registry's decision for its round?"""
    said = f"on {killed['host']} exited with code -9"
    history = wait_for(lambda: cluster.call("registry", "status")["history"], RECOVERY_S, "the registry's status")
    return any(entry["round"] == killed["round"] and said in entry["reason"] for entry in history)


def notified(log: str) -> list[tuple[int, str]]:
    """(seq, publish key) of each event an agent's log says it was delivered, in the order delivered."""
    seen = []
    for line in log.splitlines():
        if '"notified"' in line:
            record = json.loads(line)
            seen.append((int(record["seq"]), str(record.get("key"))))
    return seen


def check_decisions(cluster: ReplicatedCluster, witness: DecisionWitness) -> dict[str, int]:
    """What was lost, missed or repeated between the registry, the notifier and each agent."""
    kept = cluster.call("notifier", "since", {"seq": 0})
    published = {seq: body.get(PUBLISH_KEY) for seq, _, body in witness.events}
    mismatched = sum(
        published.get(body["seq"], body.get(PUBLISH_KEY)) != body.get(PUBLISH_KEY) for _, body in kept["events"]
    )
    seqs = [seq for seq, _, _ in witness.events]
    problems = Counter(
        published=len(seqs),
        witness_problems=witness.problems() + mismatched + (bool(seqs) and seqs[-1] != kept["latest"]),
    )
    rounds = [body["round"] for _, kind, body in witness.events if kind == Event.ROUND]
    last_round = cluster.job()["round"]
    problems["rounds_lost"] = len(set(range(1, last_round + 1)) - set(rounds))
    problems["rounds_repeated"] = len(rounds) - len(set(rounds))
    problems["job_finished_events"] = sum(kind == Event.JOB_FINISHED for _, kind, _ in witness.events)
    first_job_event = min((seq for seq, kind, _ in witness.events if kind == Event.ROUND), default=1)
    for host in HOSTS:
        delivered = notified(cluster.output(f"agent-{host}"))
        since = min(delivered[0][0] if delivered else first_job_event, first_job_event)
        expected = [(seq, str(key)) for seq, key in published.items() if seq >= since]
        problems["agent_missed"] += len(set(expected) - set(delivered))
        problems["agent_repeated"] += len(delivered) - len(set(delivered))
        problems["agent_out_of_order"] += sum(a[0] >= b[0] for a, b in zip(delivered, delivered[1:]))
        problems["agent_unknown"] += len(set(delivered) - set(expected))
    return dict(problems)


def soak(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    quota = args.quota_mib * 2**20
    etcd = EtcdCluster(workdir / "etcd", quota_bytes=quota)
    cluster: ReplicatedCluster | None = None
    witness: DecisionWitness | None = None
    client = EtcdClient(etcd.client_endpoints, deadline=30.0)
    try:
        etcd.start()
        cluster = ReplicatedCluster(workdir / "cluster", etcd, TIMING)
        cluster.start_services()
        witness = DecisionWitness(cluster)
        commits, end_file = CommitTail(workdir / "train"), workdir / "batches"
        for host in HOSTS:
            cluster.start_agent(host, 1)
        job = [sys.executable, "tests/workers/counter.py", "--batches", "100000000", "--step-delay", "0.02"]
        job += ["--log-dir", str(commits.log_dir), "--batches-file", str(end_file)]
        run = cluster.submit("--min-np", "3", "--max-restarts", "100000", "--", *job)
        wait_for(lambda: len(commits()) >= 60 and cluster.job()["state"] == "running", RECOVERY_S, "training")
        counts: Counter[str] = Counter()
        lost_reports: list[dict[str, Any]] = []
        chosen = tuple(args.kinds)
        kinds = [kind for _ in range(0, args.faults, len(chosen)) for kind in rng.sample(chosen, len(chosen))]
        recoveries: list[float] = []
        by_kind: dict[str, list[float]] = {}
        give_up_at = time.monotonic() + args.max_minutes * 60
        for number, kind in enumerate(kinds[: args.faults]):
            if time.monotonic() > give_up_at:
                print(f"--max-minutes {args.max_minutes:g} passed: {number} faults injected", flush=True)
                break
            killed = inject(kind, cluster, client, quota, HOSTS[number % len(HOSTS)])
            counts[kind] += 1
            wait_for(lambda k=killed: recovered(cluster, commits, k), RECOVERY_S, f"recovery from {kind}")
            recoveries.append(time.monotonic() - killed["at"])
            by_kind.setdefault(kind, []).append(round(recoveries[-1], 2))
            if not exit_reported(cluster, killed):
                lost_reports.append(killed)
            shown = {k: v for k, v in killed.items() if k != "at"}
            print(
                f"fault {number + 1:>3} {kind:<17} kill {shown} full size after {recoveries[-1]:.1f}s "
                f"lost_reports={len(lost_reports)}",
                flush=True,
            )
        end = max(e["batch"] for e in commits()) + END_MARGIN
        (workdir / "batches.new").write_text(str(end))
        (workdir / "batches.new").rename(end_file)
        exit_code = cluster.wait_job_end(run, 300)
        done = [e for e in read_events(commits.log_dir) if e["event"] == "done"]
        every_commit = len(done) == len(HOSTS) and {(e["batch"], e["total"]) for e in done} == {(end, sum(range(end)))}
        latest = wait_for(lambda: cluster.call("notifier", "since", {"seq": -1})["latest"], RECOVERY_S, "the notifier")
        wait_for(lambda: witness.seqs and witness.seqs[-1] >= latest, 30, "the witness to see the last event")
        for host in HOSTS:
            wait_for(
                lambda h=host: (n := notified(cluster.output(f"agent-{h}"))) and n[-1][0] >= latest,
                30,
                f"agent-{host} to log the last event",
            )
        return {
            "faults": dict(counts),
            "faults_total": sum(counts.values()),
            "worker_kills": sum(counts.values()),
            "exit_reports_lost": len(lost_reports),
            "lost_reports": lost_reports,
            "full_size_after_s_median": round(statistics.median(recoveries), 2) if recoveries else None,
            "full_size_after_s_max": round(max(recoveries), 2) if recoveries else None,
            "stalls": sum(seconds > args.stall_s for seconds in recoveries),
            "full_size_after_s": by_kind,
            **check_decisions(cluster, witness),
            "job_exit": exit_code,
            "job_state": cluster.job()["state"],
            "every_commit": every_commit,
            "final_batch": end,
        }
    except BaseException:
        if cluster is not None:
            print(cluster.dump_logs(), file=sys.stderr)
        print(etcd.dump_logs(), file=sys.stderr)
        raise
    finally:
        if witness is not None:
            witness.close()
        if cluster is not None:
            cluster.close()
        client.close()
        etcd.stop()


def clean(result: dict[str, Any]) -> bool:
    """Nothing lost, missed or repeated, and the job ended with every commit."""
    problems = [k for k in result if k.startswith(("agent_", "rounds_", "witness_"))] + ["exit_reports_lost"]
    return (
        not any(result[k] for k in problems)
        and result["job_finished_events"] == 1
        and (result["job_exit"], result["job_state"], result["every_commit"]) == (0, "succeeded", True)
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=int, default=200, help="etcd and notifier faults, one per worker kill.")
    parser.add_argument(
        "--kinds",
        type=lambda text: text.split(","),
        default=list(KINDS),
        help=f"The faults to inject, comma-separated (default all: {','.join(KINDS)}).",
    )
    parser.add_argument(
        "--stall-s", type=float, default=5.0, help="A kill not back at full size this long after counts as a stall."
    )
    parser.add_argument("--seed", type=int, default=0, help="The order of the kinds within each round of four.")
    parser.add_argument("--quota-mib", type=int, default=16, help="etcd's --quota-backend-bytes, in MiB.")
    parser.add_argument("--max-minutes", type=float, default=600, help="Stop injecting faults after this long.")
    parser.add_argument("--workdir", type=Path, help="Where the logs go (kept); default a temporary directory.")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="elastic-bench-soak-"))
    started = time.monotonic()
    result = soak(args, workdir)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["clean"] = clean(result)
    for kind in KINDS:
        print(f"FAULT {kind}: {result['faults'].get(kind, 0)}", flush=True)
    shown = {k: v for k, v in result.items() if k not in ("faults", "lost_reports", "full_size_after_s")}
    print("DECISIONS_SOAK " + " ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    if args.workdir is None and result["clean"]:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"(logs are kept in {workdir})", file=sys.stderr, flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["clean"] else 1)
