"""etcd's size over thousands of resets: does the database plateau under its quota, or grow until NOSPACE?

    python bench/etcd_size.py [--hosts 1024] [--slots 8] [--resets 10000] [--every 100] [--quota-mib 64]

A real 3-member etcd (testing/etcd_cluster.py) whose members are started with `--quota-backend-bytes` of
`--quota-mib`; the four real services on it, one replica each, and simulated agents with a job on every slot, as
bench/scale.py's etcd mode runs them. The job is then driven through `--resets` resets: one host drained, then
undrained, again and again; each is a new round that every worker joins (waited for, with a deadline).

Every `--every` resets, and after the first `--warmup` resets (10 % of them by default), each member's database
size and in-use bytes are read as the services' metrics read them (replication/store_metrics.py: `endpoint_status`),
with the store's revision; a table prints the largest member's. A watch on the control plane's keys counts the bytes
written to etcd (keys and values of every put), so the bytes per reset are measured, not estimated. At the end: the
live keys (count, bytes, the largest), the bytes and revisions per reset, the size after the warmup against the size
at the end (the goal: at most 2x), how often a replica found etcd full (its `etcd_space_exceeded` log lines,
replication/election.py) or could not compact (`etcd_not_compacted`), the NOSPACE alarms still raised, and resets
per second. The last line:

    ETCD_SIZE hosts=H slots=S resets=N quota_bytes=Q warmup=W first_db_bytes=... end_db_bytes=... max_db_bytes=...
    growth=... bytes_per_reset=... revisions_per_reset=... nospace=... not_compacted=... alarms=... resets_per_s=...

Every process started here is killed, and its temporary directory removed, on the way out, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.scale import PhaseFailed, ScaleRun
from bench.scale_agents import host_name, raise_fd_limit
from elastic_control_plane.bus.client import ServiceError
from elastic_control_plane.replication.etcd import EtcdClient, EtcdError
from elastic_control_plane.replication.store_choice import DEFAULT_PREFIX
from testing.etcd_cluster import EtcdCluster
from testing.harness import SERVICES

STATUS_TIMEOUT = 5.0  # a member's answer to a sample, on a loaded machine
GOAL_GROWTH = 2.0  # the size at the end over the size after the warmup (the first 10 % of resets by default)
LARGEST_KEYS = 5  # the largest keys said at the end: what the live data is made of
SPACE_EVENTS = ("etcd_space_exceeded", "etcd_space_reclaimed", "etcd_not_compacted")


def _stop(*_: object) -> None:
    raise SystemExit("etcd size benchmark terminated")


@dataclass
class Sample:
    resets: int
    db_bytes: int  # the largest member's database file
    in_use_bytes: int  # that member's bytes holding live data
    revision: int
    written_bytes: int  # keys and values put since the job's first round


@dataclass
class SizeReport:
    hosts: int
    slots: int
    resets: int
    quota_bytes: int
    warmup: int
    samples: list[Sample] = field(default_factory=list)
    first: Sample | None = None  # after the warmup
    events: dict[str, int] = field(default_factory=dict)
    alarms: int = 0
    refused: int = 0  # drains and undrains discovery refused (etcd slow to answer), asked again
    seconds: float = 0.0

    @property
    def end(self) -> Sample:
        return self.samples[-1]

    @property
    def growth(self) -> float:
        return self.end.db_bytes / self.first.db_bytes if self.first else math.nan

    @property
    def nospace(self) -> int:
        return self.events.get("etcd_space_exceeded", 0) + self.alarms

    def per_reset(self, name: str) -> float:
        start, end = self.samples[0], self.end
        done = end.resets - start.resets
        return (getattr(end, name) - getattr(start, name)) / done if done else math.nan

    def line(self) -> str:
        return (
            f"ETCD_SIZE hosts={self.hosts} slots={self.slots} resets={self.end.resets} quota_bytes={self.quota_bytes} "
            f"warmup={self.warmup} "
            f"first_db_bytes={self.first.db_bytes if self.first else 0} end_db_bytes={self.end.db_bytes} "
            f"max_db_bytes={max(s.db_bytes for s in self.samples)} growth={self.growth:.2f} "
            f"bytes_per_reset={self.per_reset('written_bytes'):.0f} "
            f"revisions_per_reset={self.per_reset('revision'):.1f} nospace={self.nospace} "
            f"not_compacted={self.events.get('etcd_not_compacted', 0)} alarms={self.alarms} "
            f"resets_per_s={(self.end.resets - self.samples[0].resets) / self.seconds:.2f}"
        )


class WrittenBytes:
    """A watch on the control plane's keys from a revision on, counting the bytes of the keys and values put (but
    its own markers')."""

    def __init__(self, client: EtcdClient, start_revision: int) -> None:
        self.client = client
        self.marker = f"{DEFAULT_PREFIX}/bench/etcd-size-marker".encode()
        self.bytes = 0
        self.delivered = 0  # the revision of the last event delivered
        self.missed = ""  # why the count stopped (a compaction overtook the watch), else ""
        self._stop = threading.Event()
        self._delivered = threading.Condition()
        self._thread = threading.Thread(target=self._count, args=(start_revision,), name="written-bytes", daemon=True)
        self._thread.start()

    def _count(self, start_revision: int) -> None:
        watched = f"{DEFAULT_PREFIX}/".encode()
        try:
            for revision, events in self.client.sibling().watch(
                watched, prefix=True, start_revision=start_revision, stop=self._stop
            ):
                written = sum(
                    len(e.kv.key) + len(e.kv.value) for e in events if e.kind == "put" and e.kv.key != self.marker
                )
                with self._delivered:
                    self.bytes += written
                    self.delivered = revision
                    self._delivered.notify_all()
        except EtcdError as exc:
            with self._delivered:
                self.missed = str(exc)
                self._delivered.notify_all()

    def so_far(self, timeout: float = 60.0) -> int:
        """The bytes put until now: a marker is put, and the count taken once the watch has delivered it."""
        revision = self.client.put(self.marker, b"")
        with self._delivered:
            if not self._delivered.wait_for(lambda: self.delivered >= revision or self.missed, timeout):
                raise PhaseFailed(f"the watch counting the bytes written did not reach revision {revision}")
            if self.missed:
                raise PhaseFailed(f"the watch counting the bytes written stopped: {self.missed}")
            return self.bytes

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def sample_sizes(client: EtcdClient, endpoints: list[str], resets: int, written: int) -> Sample:
    """The largest member's database size and in-use bytes, as the services' metrics read them."""
    statuses = [client.endpoint_status(endpoint, timeout=STATUS_TIMEOUT) for endpoint in endpoints]
    answered = [s for s in statuses if s is not None]
    if not answered:
        raise PhaseFailed("no etcd member answered its status")
    largest = max(answered, key=lambda s: s["db_size"])
    revision = max(s["revision"] for s in answered)
    return Sample(resets, largest["db_size"], largest["db_size_in_use"], revision, written)


def space_events(run: ScaleRun) -> dict[str, int]:
    """How many times each service logged that etcd was full, was made room in, or could not be compacted."""
    found = dict.fromkeys(SPACE_EVENTS, 0)
    for name in SERVICES:
        for line in run.cluster.output(name).splitlines():
            try:
                event = json.loads(line).get("event")
            except (json.JSONDecodeError, AttributeError):
                continue
            if event in found:
                found[event] += 1
    return found


def mark(run: ScaleRun, op: str, host: str) -> int:
    """Drain or undrain `host`, asking again while discovery refuses because etcd did not answer in time (a loaded
    machine); how many times it was refused."""
    deadline = time.monotonic() + run.deadline
    refused = 0
    while True:
        try:
            run.cluster.call("discovery", op, {"host": host}, timeout=30)
            return refused
        except ServiceError as exc:
            if time.monotonic() > deadline:
                raise PhaseFailed(f"discovery refused to {op} {host} for {run.deadline:g}s: {exc}") from None
            refused += 1


def drive(run: ScaleRun, etcd: EtcdCluster, report: SizeReport, every: int) -> None:
    """The job's first round, then `report.resets` resets (a host drained, then undrained), sampling etcd's size."""
    run.start_job()
    client = EtcdClient(etcd.client_endpoints, deadline=30.0)
    written = WrittenBytes(client, client.get_at(b"\0")[1] + 1)
    try:
        host, workers, slots = host_name(run.hosts - 1), run.workers, run.slots
        say = run.result.say
        say(f"{'resets':>8} {'db bytes':>12} {'in use':>12} {'revision':>10} {'written':>14}")

        def take(resets: int) -> None:
            sample = sample_sizes(client, etcd.client_endpoints, resets, written.so_far())
            report.samples.append(sample)
            say(
                f"{sample.resets:>8} {sample.db_bytes:>12} {sample.in_use_bytes:>12} {sample.revision:>10} "
                f"{sample.written_bytes:>14}"
            )
            if resets == report.warmup:
                report.first = sample

        take(0)
        started = time.monotonic()
        for reset in range(1, report.resets + 1):
            drained = reset % 2 == 1
            report.refused += mark(run, "drain" if drained else "undrain", host)
            expected = workers - slots if drained else workers
            run.wait_new_round(expected, f"{expected} workers to hold a rank after reset {reset}")
            if reset % every == 0 or reset in (report.warmup, report.resets):
                report.seconds = time.monotonic() - started
                take(reset)
        report.events = space_events(run)
        report.alarms = sum(1 for alarm in client.alarms() if alarm.get("alarm") == "NOSPACE")
        kvs, _ = client.get_prefix(f"{DEFAULT_PREFIX}/".encode())
        largest = sorted(kvs, key=lambda kv: -len(kv.value))[:LARGEST_KEYS]
        say(
            f"live keys at the end: {len(kvs)}, {sum(len(kv.key) + len(kv.value) for kv in kvs)} bytes; largest: "
            + ", ".join(f"{kv.key.decode(errors='replace')} {len(kv.value)}" for kv in largest)
        )
    finally:
        written.close()
        client.close()


def run_bench(
    hosts: int,
    slots: int,
    resets: int,
    every: int,
    quota_mib: int,
    warmup: int = 0,
    procs: int = 2,
    heartbeat: float = 1.0,
) -> SizeReport:
    """The whole bench on fresh etcd members and services, all of them stopped and their files removed at the end."""
    report = SizeReport(hosts, slots, resets, quota_mib * 2**20, min(resets, warmup or max(1, math.ceil(resets / 10))))
    with tempfile.TemporaryDirectory(prefix="elastic-etcd-size-") as tmp:
        etcd = EtcdCluster(Path(tmp) / "etcd", quota_bytes=report.quota_bytes)
        try:
            etcd.start()
            run = ScaleRun(Path(tmp), hosts, slots, procs, heartbeat, "etcd", etcd.store_url)
            try:
                run.result.say(
                    f"== etcd size: {hosts} hosts x {slots} slots, {resets} resets, quota {quota_mib} MiB =="
                )
                drive(run, etcd, report, every)
            finally:
                run.close()
        finally:
            etcd.stop()
    print(
        f"bytes written per reset {report.per_reset('written_bytes'):.0f}, revisions per reset "
        f"{report.per_reset('revision'):.1f}; db after the warmup ({report.warmup} resets) "
        f"{report.first.db_bytes if report.first else 0}, at the end {report.end.db_bytes} "
        f"(x{report.growth:.2f}; goal <= x{GOAL_GROWTH:g}); space events "
        f"{report.events}, NOSPACE alarms raised at the end {report.alarms}; drains refused and asked again "
        f"{report.refused}",
        flush=True,
    )
    print(report.line(), flush=True)
    return report


def main(argv: list[str] | None = None) -> SizeReport:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=1024, help="Simulated hosts (at least 3).")
    parser.add_argument("--slots", type=int, default=8, help="Slots (workers) per host.")
    parser.add_argument("--resets", type=int, default=10_000, help="Resets to drive the job through.")
    parser.add_argument("--every", type=int, default=100, help="Sample etcd's size every this many resets.")
    parser.add_argument("--quota-mib", type=int, default=64, help="Each member's --quota-backend-bytes, in MiB.")
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="The resets after which the size is the baseline of the growth (default: 10 %% of --resets).",
    )
    parser.add_argument("--procs", type=int, default=2, help="Simulator processes the agents are spread over.")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="Heartbeat interval in seconds.")
    args = parser.parse_args(argv)
    if args.hosts < 3 or args.resets < 1 or args.every < 1:
        parser.error("--hosts must be at least 3, --resets and --every at least 1")
    signal.signal(signal.SIGTERM, _stop)
    raise_fd_limit()
    return run_bench(
        args.hosts, args.slots, args.resets, args.every, args.quota_mib, args.warmup, args.procs, args.heartbeat
    )


if __name__ == "__main__":
    try:
        main()
    except PhaseFailed as exc:
        print(f"FAILED: {exc}", flush=True)
        sys.exit(1)
