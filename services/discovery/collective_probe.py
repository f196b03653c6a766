"""Discovery's part in the collective probe (a mixin of services/discovery/service.py's DiscoveryService): which
hosts are probed, the probes asked of their agents, and the judgement.

A host is probed when it is about to enter the job: its agent runs with `--collective-probe` (its health report
carries a `probe`: agent/collective_probe.py), it would be available but for the probe, and it is not in the job
(not among the hosts last published, nor, on a restarted discovery still settling, in the registry's round). Hosts
already in the job are never probed; a host that leaves the job (lost, blacklisted, drained, unhealthy) is probed
again when it returns. Until it passes, the host is held (state `unhealthy`, its reason in `health_hold`).

Hosts waiting together share one probe: it begins once every host due has its probe process up and none joined the
wait for GATHER_QUIET seconds (or the first has waited GATHER_MAX). Its first host (by name) leads: its agent's
probe process serves the store. Each agent is asked in its next heartbeat's reply, `probe: {id, rank, size, store}`,
and sends its result with its next health report. Once every result is in (or PROBE_DEADLINE passed), each host is
judged (`judge`): held back when its own share of the workload took at least `slow_factor` times, and MIN_EXCESS
seconds more than, the median of the others' (the other probed hosts, and the times the hosts in the job had when
they were probed), or when it sent no time; it is probed again after RETRY_AFTER seconds.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_control_plane.services.discovery.admission import health_hold
from elastic_control_plane.services.discovery.hostset import ACTIVE, UNHEALTHY, HostRecord, HostSet

DEFAULT_SLOW_FACTOR = 3.0
MIN_EXCESS = 0.2  # seconds over the median: below it a ratio is noise (a probe's share is a few tenths of a second)
GATHER_QUIET = 0.3
GATHER_MAX = 5.0  # seconds: hosts entering together are probed together, even when one's probe process starts late
PROBE_DEADLINE = 15.0  # seconds for every result: gloo's timeout in the probe is 10 s, a heartbeat carries the ask
RETRY_AFTER = 30.0
TICK = 0.1
PENDING, RUNNING = "collective probe pending", "collective probe running"


@dataclass
class Probe:
    id: int
    hosts: list[str]
    store: str
    started: float
    results: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class HostProbe:
    passed: bool = False
    seconds: float | None = None  # its share when it passed
    retry_at: float = 0.0


def judge(results: dict[str, dict[str, Any]], in_job: list[float], slow_factor: float) -> dict[str, str | None]:
    """Each probed host's hold (None: it passes). `results`: host -> {seconds} or {error}; `in_job`: the seconds the
    hosts already in the job took when they were probed."""
    timed = {host: result["seconds"] for host, result in results.items() if result.get("seconds") is not None}
    holds: dict[str, str | None] = {}
    for host, result in results.items():
        if host not in timed:
            holds[host] = f"collective probe failed: {result.get('error') or 'no result'}"
            continue
        others = [seconds for other, seconds in timed.items() if other != host] + in_job
        if not others:
            holds[host] = None
            continue
        median, seconds = statistics.median(others), timed[host]
        ratio = seconds / max(median, 1e-3)
        slow = ratio >= slow_factor and seconds - median >= MIN_EXCESS
        holds[host] = (
            f"collective probe: {seconds:.2f}s, {ratio:.1f}x the others' median ({median:.2f}s)" if slow else None
        )
    return holds


class CollectiveProbes:
    hostset: HostSet
    log: Any
    clock: Callable[[], float]
    published: list[tuple[str, tuple[int, ...]]]
    expected: list[tuple[str, tuple[int, ...]]] | None
    _changed: Callable[[], None]  # the service's: the host set changed
    every: Callable[..., Any]

    def start_probes(self, slow_factor: float) -> None:
        self.probe_slow_factor = slow_factor
        self.probe: Probe | None = None
        self.host_probes: dict[str, HostProbe] = {}  # the hosts whose agents probe
        self._gather: tuple[tuple[str, ...], float, float] = ((), 0.0, 0.0)  # the hosts waiting, since, changed at
        self.every(TICK, self._probe_tick)

    def _take_probe(self, host: str, health: dict[str, Any] | None) -> dict[str, Any]:
        """A health report came: its probe's result is taken; what the agent is asked in reply (a probe, or
        nothing). A host first seen probing is held at once unless it is in the job, so that it cannot be published
        between two ticks."""
        report = health.get("probe") if health is not None else None
        if report is None:
            return {}
        if host not in self.host_probes:
            self.host_probes[host] = HostProbe()
            if host not in self._in_job():
                self._hold(self.hostset.hosts[host], PENDING)
        probe = self.probe
        if probe is None or host not in probe.hosts or host in probe.results:
            return {}
        if report["id"] != probe.id:
            ask = {"id": probe.id, "rank": probe.hosts.index(host), "size": len(probe.hosts), "store": probe.store}
            return {"probe": ask}
        if report["seconds"] is not None or report["error"] is not None:
            probe.results[host] = {"seconds": report["seconds"], "error": report["error"]}
            if len(probe.results) == len(probe.hosts):
                self._judge(probe)
        return {}

    def _in_job(self) -> set[str]:
        return {name for name, _ in self.published} | {name for name, _ in self.expected or ()}

    def _only_probe_holds(self, record: HostRecord) -> bool:
        """Whether the host would be available but for the probe."""
        state = self.hostset.state(record)
        if state == ACTIVE:
            return True
        return (
            state == UNHEALTHY
            and record.probe_hold is not None
            and health_hold(record.health, record.health_wanted) is None
        )

    def _hold(self, record: HostRecord, reason: str | None) -> None:
        if record.probe_hold != reason:
            record.probe_hold = reason
            self._changed()

    def _probe_tick(self) -> None:
        now = self.clock()
        if self.probe is not None and now - self.probe.started > PROBE_DEADLINE:
            for host in self.probe.hosts:
                self.probe.results.setdefault(host, {"seconds": None, "error": f"no result within {PROBE_DEADLINE:g}s"})
            self._judge(self.probe)
        in_job = self._in_job()
        due, ready = [], []
        for name in list(self.host_probes):
            record, state = self.hostset.hosts.get(name), self.host_probes[name]
            report = (record.health or {}).get("probe") if record is not None else None
            if record is None or report is None:
                del self.host_probes[name]
                if record is not None:
                    self._hold(record, None)
                continue
            if name in in_job:
                self._hold(record, None)
            elif not self._only_probe_holds(record):  # out of the job: probed when it returns
                state.passed = False
                if record.probe_hold is None:
                    self._hold(record, PENDING)
            elif state.passed:
                self._hold(record, None)
            elif (self.probe is None or name not in self.probe.hosts) and now >= state.retry_at:
                due.append(name)
                if report["store"] is not None:
                    ready.append(name)
                elif report["error"]:
                    self._hold(record, f"collective probe unavailable: {report['error']}")
        self._gather_and_start(sorted(due), sorted(ready), now)

    def _gather_and_start(self, due: list[str], ready: list[str], now: float) -> None:
        """Begin a probe of the ready hosts once the hosts due have not changed for GATHER_QUIET and all are ready,
        or the first has waited GATHER_MAX (a host whose probe process still starts waits for the next probe)."""
        hosts, since, changed = self._gather
        if not ready or self.probe is not None:
            self._gather = ((), 0.0, 0.0)
            return
        if tuple(due) != hosts:
            self._gather = (tuple(due), since if hosts else now, now)
            hosts, since, changed = self._gather
        settled = len(ready) == len(due) and now - changed >= GATHER_QUIET
        if not settled and now - since < GATHER_MAX:
            return
        store = self.hostset.hosts[ready[0]].health["probe"]["store"]
        self.probe = Probe(random.getrandbits(62), list(ready), store, now)
        self._gather = ((), 0.0, 0.0)
        for host in ready:
            self._hold(self.hostset.hosts[host], RUNNING)
        self.log.info("collective_probe_started", probe=self.probe.id, hosts=ready, leader=ready[0])

    def _judge(self, probe: Probe) -> None:
        self.probe = None
        now = self.clock()
        in_job = [
            state.seconds
            for name, state in self.host_probes.items()
            if state.passed and state.seconds is not None and name not in probe.hosts
        ]
        holds = judge(probe.results, in_job, self.probe_slow_factor)
        for host, reason in holds.items():
            record, state = self.hostset.hosts.get(host), self.host_probes.get(host)
            if record is None or state is None:
                continue
            if reason is None:
                state.passed, state.seconds = True, probe.results[host]["seconds"]
            else:
                state.retry_at = now + RETRY_AFTER
            self._hold(record, reason)
        self.log.info(
            "collective_probe_judged",
            probe=probe.id,
            took_s=round(now - probe.started, 3),
            seconds={host: result["seconds"] for host, result in probe.results.items()},
            held={host: reason for host, reason in holds.items() if reason},
        )
