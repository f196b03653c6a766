"""WaitBoard: the registry's reading of the agents' `waits` reports (how long each worker waits for the others), which
worker hangs the others, what each rank costs them, and the hang limits the agents are told.

Every worker records its waits in collectives (slot_processes/wait_record.py);
its agent reports them (`parse_waits` reads one report at the door). Only the
reports of the current round's workers count (`_counts`): the round and pid
the job's `ReportTable` has for the slot, a slot not yet failed or exited, a
running job that detects hangs. A report older than `fresh_s` (three
heartbeats) is never judged: a silent agent is a lost host, which discovery
handles.

The limits (`limits_of`): `limit` is MARGIN times the longest wait and the
typical time between waits any report of the job showed (the maxima kept in
`Job.wait_calibration`, saved with the job), at least FLOOR_S and at most the
job's `hung_timeout`, which is `upper`. A slot is a suspect (`hung_after`)
when it is not waiting, is past the first IGNORED_WAITS waits of its round
(they wait for ranks that restore, load or compile) and has been busy for T:
`limit` when it made no progress of its own (no CPU time, no I/O) for
`limit`, else `upper` (it computes or writes: a checkpoint save or a first
compile is no hang before the explicit bound). A suspect is hung when another
slot of the round waits for T. Its agent is sent `kill_worker` (with a stack
dump), again every REKILL_AFTER_S while the same pid reports; the slot fails
when its agent reports the exit (services/registry/exits.py).

A rank's cost to the others: in a synchronous job every rank spends the same
wall time, so rank r kept the rank that waits most waiting for the difference
of their wait fractions. Each slot keeps an exponentially weighted wait
fraction (time constant FRACTION_TAU_S) from the seconds it waited (finished
waits plus the one under way) between two of its reports; its cost rate is
the largest fresh fraction of the round (`_fastest_fraction`, scanned at most
every FASTEST_REFRESH_S) minus its own, and each report adds rate x interval
to its `lost_s`. A rate of STRAGGLER_SHARE or more held for STRAGGLER_AFTER_S
makes one `straggler` event per episode; a straggler is never killed.

Bounded: the board holds the slots of the current round only (a new round
drops the others) and two indexes of the few slots that matter to a
judgement (long waiters, suspects), so a report costs the size of its host;
the round is scanned at most once a second (the largest wait fraction) and
the long waiters when a suspect is judged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from bus.jobspec import JobSpec
from bus.service import RequestError
from bus.service import field as body_field
from services.registry.job import RUNNING_JOB, Job
from services.registry.reports import SILENT, Slot
from slot_processes.wait_record import IGNORED_WAITS

FLOOR_S = 3.0
MARGIN = 5.0  # NVRx's margin over the longest wait seen
FRESH_HEARTBEATS = 3  # a report older than this many heartbeat intervals is never judged
REKILL_AFTER_S = 10.0
FRACTION_TAU_S = 10.0
FASTEST_REFRESH_S = 1.0
STRAGGLER_SHARE = 0.1  # 6 s lost per minute
STRAGGLER_AFTER_S = 30.0
SLOWEST_SHOWN = 5
CALIBRATION = ("longest_wait_s", "typical_busy_s")


@dataclass(frozen=True)
class WaitRow:
    """One worker's waits as its agent saw them when it sent the report."""

    local_rank: int
    pid: int
    round: int
    waits: int
    waiting_s: float | None
    busy_s: float | None
    stalled_s: float | None
    longest_wait_s: float
    typical_busy_s: float
    waited_total_s: float

    @property
    def waited_s(self) -> float:
        """Seconds waited over the worker's life, the wait under way included."""
        return self.waited_total_s + (self.waiting_s or 0.0)


def parse_waits(body: dict[str, Any]) -> tuple[str, list[WaitRow]]:
    """The host and its rows of a `waits` request; a `bad_request` error naming the first field that is wrong."""
    host, slots = body_field(body, "host", str), body.get("slots")
    if not isinstance(slots, list):
        raise RequestError("bad_request", "field 'slots' must be a list")
    return host, [_row(item, f"slots[{index}]") for index, item in enumerate(slots)]


def _row(item: Any, where: str) -> WaitRow:
    if not isinstance(item, dict):
        raise RequestError("bad_request", f"{where} must be a map")
    counts = {name: _count(item, name, where) for name in ("local_rank", "pid", "round", "waits")}
    spans = {name: _seconds(item, name, where, optional=True) for name in ("waiting_s", "busy_s", "stalled_s")}
    totals = {name: _seconds(item, name, where) for name in ("longest_wait_s", "typical_busy_s", "waited_total_s")}
    return WaitRow(**counts, **spans, **totals)


def _count(item: dict[str, Any], name: str, where: str) -> int:
    value = item.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RequestError("bad_request", f"{where}.{name} must be an integer >= 0")
    return value


def _seconds(item: dict[str, Any], name: str, where: str, optional: bool = False) -> Any:
    value = item.get(name)
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
        raise RequestError("bad_request", f"{where}.{name} must be seconds >= 0" + (" or null" if optional else ""))
    return float(value)


@dataclass(frozen=True)
class Limits:
    limit_s: float
    upper_s: float

    def to_wire(self) -> dict[str, float]:
        return {"limit_s": self.limit_s, "upper_s": self.upper_s}


NO_LIMITS = {"limit_s": None, "upper_s": None}  # the limits told while no running job detects hangs


def limits_of(spec: JobSpec, calibration: MutableMapping[str, float]) -> Limits:
    calibrated = MARGIN * max(calibration.get(name, 0.0) for name in CALIBRATION)
    return Limits(min(spec.hung_timeout, max(FLOOR_S, calibrated)), spec.hung_timeout)


def judged_limits(job: Job) -> Limits | None:
    """The limits the job's hangs are judged by; None unless it runs and detects hangs."""
    spec = _judged_spec(job)
    return None if spec is None else limits_of(spec, job.wait_calibration)


def _judged_spec(job: Job) -> JobSpec | None:
    """The spec of a job whose hangs are judged: it runs and detects hangs."""
    if job.state != RUNNING_JOB or job.spec is None or not job.spec.hang_detection:
        return None
    return job.spec


def calibrate(calibration: MutableMapping[str, float], rows: Iterable[WaitRow]) -> bool:
    """Raise the job's maxima with `rows`; True when one rose."""
    rose = False
    for row in rows:
        for name, value in (("longest_wait_s", row.longest_wait_s), ("typical_busy_s", row.typical_busy_s)):
            if value > calibration.get(name, 0.0):
                calibration[name], rose = value, True
    return rose


def hung_after(row: WaitRow, limits: Limits) -> float | None:
    """How long the others must wait for this worker for it to be hung (it is a suspect); None when it is none."""
    if row.waiting_s is not None or row.busy_s is None or row.waits < IGNORED_WAITS:
        return None
    stalled = row.stalled_s is not None and row.stalled_s >= limits.limit_s
    threshold = limits.limit_s if stalled else limits.upper_s
    return threshold if row.busy_s >= threshold else None


@dataclass
class SlotWaits:
    """What the board keeps of one slot of the round: its worker's last report and what it costs the others."""

    row: WaitRow
    received_at: float
    fraction: float | None = None  # the weighted share of its time it waits (None until a second report)
    cost_rate: float = 0.0  # seconds the others wait for it per second
    lost_s: float = 0.0  # seconds the others waited for it while the slot stayed in the job's rounds
    costly_since: float | None = None  # since when its cost rate is at least STRAGGLER_SHARE
    told_straggler: bool = False  # this episode's `straggler` event was sent
    killed: tuple[int, float] | None = None  # (pid, when) of the last `kill_worker` sent


@dataclass(frozen=True)
class Kill:
    event: dict[str, Any]  # the `kill_worker` event's body
    rank: int
    first: bool  # the first for this worker (not a resend)


@dataclass
class Seen:
    """What one `waits` report changed: the limits the agent is told, the kills and straggler events to send, the
    seconds the others waited for the host's ranks, whether the calibration rose and whether a round began."""

    limits: Limits | None
    new_round: bool
    calibrated: bool = False
    kills: list[Kill] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    waited_for: dict[str, float] = field(default_factory=dict)


class WaitBoard:
    def __init__(self, fresh_s: float) -> None:
        self.fresh_s = fresh_s
        self._watching = (0, 0)  # (job, round) the slots belong to
        self._slots: dict[Slot, SlotWaits] = {}
        self._long_waiters: dict[Slot, None] = {}  # waiting at least the limit when they last reported
        self._suspects: dict[Slot, None] = {}  # a suspect (`hung_after`) when they last reported
        self._fastest, self._fastest_at = 0.0, -math.inf

    def __len__(self) -> int:
        """The slots whose reports it keeps (the current round's, at most)."""
        return len(self._slots)

    def note(self, job: Job, host: str, rows: list[WaitRow], now: float) -> Seen:
        """A host's report, received at `now`: calibrate, account and judge."""
        new_round = self._follow(job)
        spec = _judged_spec(job)
        if spec is None:
            return Seen(None, new_round)
        counted = {(host, row.local_rank): row for row in rows if _counts(job, (host, row.local_rank), row)}
        calibrated = calibrate(job.wait_calibration, counted.values())
        limits = limits_of(spec, job.wait_calibration)
        seen = Seen(limits, new_round, calibrated)
        intervals = {slot: self._record(slot, row, now, limits) for slot, row in counted.items()}
        self._account(job, intervals, now, seen)
        self._judge(job, list(counted), limits, now, seen)
        return seen

    def summary(self, job: Job, now: float) -> dict[str, Any]:
        """The `waits` part of the registry's `status`: the limits and the ranks that cost the others most."""
        limits = judged_limits(job)
        costly = [
            (slot, state)
            for slot, state in self._slots.items()
            if round(60 * state.cost_rate, 1) > 0 and self._live(job, slot, now)
        ]
        costly.sort(key=lambda item: item[1].cost_rate, reverse=True)
        ranks = [
            {
                "host": slot[0],
                "local_rank": slot[1],
                "rank": job.reports[slot].rank,
                "lost_s_per_min": round(60 * state.cost_rate, 1),
                "lost_s": round(state.lost_s, 1),
            }
            for slot, state in costly[:SLOWEST_SHOWN]
        ]
        return {**(NO_LIMITS if limits is None else limits.to_wire()), "ranks": ranks}

    def _follow(self, job: Job) -> bool:
        """Keep only the slots of the job's current round; True when a round (or job) began since the last report."""
        if self._watching == (job.job_id, job.round):
            return False
        if self._watching[0] != job.job_id:
            self._slots.clear()
        for slot in [slot for slot in self._slots if slot not in job.reports.reports]:
            del self._slots[slot]
        self._watching = (job.job_id, job.round)
        self._long_waiters.clear()
        self._suspects.clear()
        self._fastest, self._fastest_at = 0.0, -math.inf
        return True

    def _live(self, job: Job, slot: Slot, now: float) -> bool:
        """Does the slot's last report still count: fresh, and of the round's worker that has not ended?"""
        state = self._slots.get(slot)
        return state is not None and now - state.received_at <= self.fresh_s and _counts(job, slot, state.row)

    def _record(self, slot: Slot, row: WaitRow, now: float, limits: Limits) -> float | None:
        """Keep the slot's report and its wait fraction; the seconds since its previous report when this one
        continues it (same worker and round, not stale), else None: a new baseline."""
        state = self._slots.get(slot)
        interval = None
        if state is None:
            self._slots[slot] = state = SlotWaits(row, now)
        elif state.row.pid == row.pid and state.row.round == row.round and now - state.received_at <= self.fresh_s:
            interval = now - state.received_at
            if interval > 0:
                sample = min(1.0, max(0.0, (row.waited_s - state.row.waited_s) / interval))
                weight = 1.0 - math.exp(-interval / FRACTION_TAU_S)
                state.fraction = (
                    sample if state.fraction is None else state.fraction + weight * (sample - state.fraction)
                )
                self._fastest = max(self._fastest, state.fraction)
        else:
            state.fraction, state.cost_rate, state.costly_since, state.told_straggler = None, 0.0, None, False
        state.row, state.received_at = row, now
        self._long_waiters.pop(slot, None)
        self._suspects.pop(slot, None)
        if row.waiting_s is not None and row.waiting_s >= limits.limit_s:
            self._long_waiters[slot] = None
        if hung_after(row, limits) is not None:
            self._suspects[slot] = None
        return interval or None

    def _fastest_fraction(self, now: float) -> float:
        """The largest wait fraction of the round's fresh slots (scanned again after FASTEST_REFRESH_S)."""
        if now - self._fastest_at >= FASTEST_REFRESH_S:
            fresh = (
                s.fraction
                for s in self._slots.values()
                if s.fraction is not None and now - s.received_at <= self.fresh_s
            )
            self._fastest, self._fastest_at = max(fresh, default=0.0), now
        return self._fastest

    def _account(self, job: Job, intervals: dict[Slot, float | None], now: float, seen: Seen) -> None:
        """Each reported slot's cost to the others over its interval, and the stragglers it makes."""
        fastest = self._fastest_fraction(now)
        for slot, interval in intervals.items():
            state = self._slots[slot]
            if interval is None or state.fraction is None:
                continue
            state.cost_rate = max(0.0, fastest - state.fraction)
            lost = state.cost_rate * interval
            state.lost_s += lost
            seen.waited_for[slot[0]] = seen.waited_for.get(slot[0], 0.0) + lost
            if state.cost_rate < STRAGGLER_SHARE:
                state.costly_since, state.told_straggler = None, False
            elif state.costly_since is None:
                state.costly_since = now
            elif not state.told_straggler and now - state.costly_since >= STRAGGLER_AFTER_S:
                state.told_straggler = True
                seen.stragglers.append(
                    {
                        "host": slot[0],
                        "local_rank": slot[1],
                        "rank": job.reports[slot].rank,
                        "lost_s_per_min": round(60 * state.cost_rate, 1),
                    }
                )

    def _judge(self, job: Job, reported: list[Slot], limits: Limits, now: float, seen: Seen) -> None:
        """The suspects this report concerns (its own, or all when one of its slots waits long) that others wait
        for: each gets `kill_worker`, at most once per REKILL_AFTER_S for the same pid."""
        candidates = dict.fromkeys(slot for slot in reported if slot in self._suspects)
        if any(slot in self._long_waiters for slot in reported):
            candidates.update(self._suspects)
        for slot in candidates:
            if not self._live(job, slot, now):
                self._suspects.pop(slot, None)
                continue
            state = self._slots[slot]
            threshold = hung_after(state.row, limits)
            if threshold is None:
                continue
            pid, killed = state.row.pid, state.killed
            if killed is not None and killed[0] == pid and now - killed[1] < REKILL_AFTER_S:
                continue
            waits = [self._slots[other].row.waiting_s or 0.0 for other in self._waiting_for(job, slot, threshold, now)]
            if not waits:
                continue
            state.killed = (pid, now)
            rank = job.reports[slot].rank
            reason = f"hung: the others waited {max(waits):.1f}s for rank {rank} ({_why(state.row, threshold, limits)})"
            event = {"host": slot[0], "local_rank": slot[1], "pid": pid, "reason": reason, "dump_stack": True}
            seen.kills.append(Kill(event, rank, first=killed is None or killed[0] != pid))

    def _waiting_for(self, job: Job, suspect: Slot, threshold: float, now: float) -> list[Slot]:
        """The other slots that wait at least `threshold` (the long waiters no longer live leave the index)."""
        waiting = []
        for other in list(self._long_waiters):
            if not self._live(job, other, now):
                del self._long_waiters[other]
            elif other != suspect and (self._slots[other].row.waiting_s or 0.0) >= threshold:
                waiting.append(other)
        return waiting


def _why(row: WaitRow, threshold: float, limits: Limits) -> str:
    if threshold == limits.limit_s and row.stalled_s is not None and row.stalled_s >= limits.limit_s:
        return f"limit {limits.limit_s:.1f}s, no progress for {row.stalled_s:.1f}s"
    return f"upper bound {limits.upper_s:g}s, busy for {row.busy_s or 0.0:.1f}s"


def _counts(job: Job, slot: Slot, row: WaitRow) -> bool:
    """Is `row` the report of the current round's worker of `slot`, which has not ended?"""
    report = job.reports.reports.get(slot)
    return row.round == job.round and report is not None and report.state in SILENT and report.pid == row.pid
