"""WaitBoard: the registry's reading of the agents' `waits` reports (how long each worker waits for the others), which
worker hangs the others, what each rank costs them, and the hang limits the agents are told.

Every worker records its waits in collectives (slot_processes/wait_record.py); its agent reports them
(services/registry/wait_rows.py reads one report at the door). Only the reports of the current round's workers count
(`_counts`): the round and pid the job's `ReportTable` has for the slot, a slot not yet failed or exited, a running
job that detects hangs. A report older than `fresh_s` (three heartbeats) is never judged: a silent agent is a lost
host, which discovery handles. A fresh row is judged as it stands when the board judges (`WaitRow.aged`: a wait or a
stall under way goes on since its report), so the report that crosses a limit first is judged together with the
others' rows, not against what they said up to three heartbeats before.

The limits and what a row is judged (services/registry/hang_limits.py). When another slot of the round waits for a
suspect as long as its stage asks, a SUSPECT is told once per stall (`worker_suspected`: its agent prints its stack
and lets it run) and a HUNG slot's agent is sent `kill_worker` (with a stack dump), again every REKILL_AFTER_S while
the same pid reports; the slot fails when its agent reports the exit (services/registry/exits.py). A kill for no
progress doubles the slot's later limits (`Job.hang_doublings`).

The collective timeout. While some live slot of the round is judged (busy, bounded by the upper bound at least, or
inside a declared wait, which ends), the others' waits are bounded by the judgement, not by the collective timeout:
every reply says so (`excuse_s`: `fresh_s`; 0 when no slot is judged, as when every rank waits and none is stopped:
a stopped one's agent reports it busy), and the agents let their workers wait on past the timeout for that long.

A rank's cost to the others: in a synchronous job every rank spends the same wall time, so rank r kept the rank that
waits most waiting for the difference of their wait fractions. Each slot keeps an exponentially weighted wait
fraction (time constant FRACTION_TAU_S) from the seconds it waited (finished waits plus the one under way) between
two of its reports; its cost rate is the largest fresh fraction of the round (`_fastest_fraction`, scanned at most
every FASTEST_REFRESH_S) minus its own, and each report adds rate x interval to its `lost_s`. A rate of
STRAGGLER_SHARE or more held for STRAGGLER_AFTER_S makes one `straggler` event per episode; a straggler is never
killed.

Bounded: the board holds the slots of the current round only (a new round drops the others) and two indexes of the
few slots that matter to a judgement (long waiters, suspects), so a report costs the size of its host; the round is
scanned at most once a second (the largest wait fraction) and the long waiters when a suspect is judged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_control_plane.services.registry.hang_limits import (
    HUNG,
    MAX_DOUBLINGS,
    NO_LIMITS,
    RECOVERED_WAITS,
    SUSPECT,
    Limits,
    calibrate,
    doublings_for,
    judged,
    judged_limits,
    judged_spec,
    limits_of,
    slot_key,
    stage,
    why,
)
from elastic_control_plane.services.registry.job import Job
from elastic_control_plane.services.registry.reports import SILENT, Slot
from elastic_control_plane.services.registry.wait_rows import WaitRow

FRESH_HEARTBEATS = 3  # a report older than this many heartbeat intervals is never judged
REKILL_AFTER_S = 10.0
FRACTION_TAU_S = 10.0
FASTEST_REFRESH_S = 1.0
STRAGGLER_SHARE = 0.1  # 6 s lost per minute
STRAGGLER_AFTER_S = 30.0
SLOWEST_SHOWN = 5


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
    suspected: int | None = None  # the pid told as suspected in this stall (None once it moves again)


@dataclass(frozen=True)
class Kill:
    event: dict[str, Any]  # the `kill_worker` event's body
    rank: int
    first: bool  # the first for this worker (not a resend)
    waited_s: float = 0.0  # how long the others had waited for it (the goodput ledger's fault began then)


@dataclass
class Seen:
    """What one `waits` report changed: the limits the agent is told and how long its workers may wait past the
    collective timeout, the suspects, kills and straggler events to send, the seconds the others waited for the
    host's ranks, whether the saved job changed (calibration, doublings) and whether a round began."""

    limits: Limits | None
    new_round: bool
    job_changed: bool = False
    excuse_s: float = 0.0
    suspects: list[dict[str, Any]] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    waited_for: dict[str, float] = field(default_factory=dict)

    def reply(self) -> dict[str, Any]:
        """The reply to the agent's `waits`."""
        return {**(NO_LIMITS if self.limits is None else self.limits.to_wire()), "excuse_s": self.excuse_s}


class WaitBoard:
    def __init__(self, fresh_s: float) -> None:
        self.fresh_s = fresh_s
        self._watching = (0, 0)  # (job, round) the slots belong to
        self._slots: dict[Slot, SlotWaits] = {}
        self._long_waiters: dict[Slot, None] = {}  # waiting at least the limit when they last reported
        self._suspects: dict[Slot, None] = {}  # at a `stage` when they last reported
        self._judged: dict[Slot, None] = {}  # under judgement (`judged`) when they last reported
        self._fastest, self._fastest_at = 0.0, -math.inf

    def __len__(self) -> int:
        """The slots whose reports it keeps (the current round's, at most)."""
        return len(self._slots)

    def note(self, job: Job, host: str, rows: list[WaitRow], now: float) -> Seen:
        """A host's report, received at `now`: calibrate, account and judge."""
        new_round = self._follow(job)
        spec = judged_spec(job)
        if spec is None:
            return Seen(None, new_round)
        counted = {(host, row.local_rank): row for row in rows if _counts(job, (host, row.local_rank), row)}
        calibrated = calibrate(job.wait_calibration, counted.values())
        limits = limits_of(spec, job.wait_calibration)
        seen = Seen(limits, new_round, calibrated)
        intervals = {slot: self._record(job, slot, row, now, limits, seen) for slot, row in counted.items()}
        self._account(job, intervals, now, seen)
        self._judge(job, list(counted), limits, now, seen)
        if self._someone_judged(job, now):
            seen.excuse_s = self.fresh_s
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
        return {
            **(NO_LIMITS if limits is None else limits.to_wire()),
            "ranks": ranks,
            "suspected": self._suspected_rows(job, now, limits),
            "declared": self._live_rows(job, now, _declared),
            "stopped": self._live_rows(job, now, _stopped),
        }

    def _suspected_rows(self, job: Job, now: float, limits: Limits | None) -> list[dict[str, Any]]:
        """The live slots told as suspected in their current stall, for `status`."""
        rows = []
        for slot in self._suspects:
            state = self._slots.get(slot)
            if state is None or state.suspected != state.row.pid or limits is None or not self._live(job, slot, now):
                continue
            own = limits.doubled(doublings_for(job, slot, state.row.pid))
            rows.append(
                {
                    "host": slot[0],
                    "local_rank": slot[1],
                    "rank": job.reports[slot].rank,
                    "pid": state.row.pid,
                    "stalled_s": round(state.row.stalled_s or 0.0, 1),
                    "kill_at_s": own.kill_s,
                }
            )
        return rows

    def _live_rows(self, job: Job, now: float, shown: Callable[[WaitRow], dict[str, Any] | None]) -> list[dict]:
        """For `status`: each live slot whose row, as it stands `now`, `shown` says something of."""
        rows = []
        for slot, state in self._slots.items():
            said = shown(state.row.aged(now - state.received_at))
            if said is not None and self._live(job, slot, now):
                rows.append({"host": slot[0], "local_rank": slot[1], "rank": job.reports[slot].rank, **said})
        return rows

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
        self._judged.clear()
        self._fastest, self._fastest_at = 0.0, -math.inf
        return True

    def _live(self, job: Job, slot: Slot, now: float) -> bool:
        """Does the slot's last report still count: fresh, and of the round's worker that has not ended?"""
        state = self._slots.get(slot)
        return state is not None and now - state.received_at <= self.fresh_s and _counts(job, slot, state.row)

    def _record(self, job: Job, slot: Slot, row: WaitRow, now: float, limits: Limits, seen: Seen) -> float | None:
        """Keep the slot's report and its wait fraction (a worker that trained RECOVERED_WAITS waits in its round
        clears the slot's doublings); the seconds since its previous report when this one continues it (same worker
        and round, not stale), else None: a new baseline."""
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
        if row.waits >= RECOVERED_WAITS and job.hang_doublings.pop(slot_key(slot), None) is not None:
            seen.job_changed = True
        self._long_waiters.pop(slot, None)
        self._suspects.pop(slot, None)
        self._judged.pop(slot, None)
        if row.waiting_s is not None and row.waiting_s >= limits.limit_s:
            self._long_waiters[slot] = None
        if stage(row, limits) is not None:
            self._suspects[slot] = None
        elif state.suspected is not None:
            state.suspected = None  # it moved again: a later stall is a new suspicion
        if judged(row):
            self._judged[slot] = None
        return interval or None

    def _someone_judged(self, job: Job, now: float) -> bool:
        """Is a live slot of the round under judgement (the ones no longer live leave the index)?"""
        for slot in list(self._judged):
            if self._live(job, slot, now):
                return True
            del self._judged[slot]
        return False

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
        for: a SUSPECT is told once per stall, a HUNG one gets `kill_worker`, at most once per REKILL_AFTER_S for the
        same pid."""
        candidates = dict.fromkeys(slot for slot in reported if slot in self._suspects)
        if any(slot in self._long_waiters for slot in reported):
            candidates.update(self._suspects)
        for slot in candidates:
            if not self._live(job, slot, now):
                self._suspects.pop(slot, None)
                continue
            state = self._slots[slot]
            pid, killed = state.row.pid, state.killed
            doublings = doublings_for(job, slot, pid)
            own = limits.doubled(doublings)
            row = state.row.aged(now - state.received_at)
            judgement = stage(row, own)
            if judgement is None:
                continue
            verdict, threshold = judgement
            if verdict == SUSPECT and state.suspected == pid:
                continue
            if verdict == HUNG and killed is not None and killed[0] == pid and now - killed[1] < REKILL_AFTER_S:
                continue
            waits = self._waiting_for(job, slot, threshold, now)
            if not waits:
                continue
            rank = job.reports[slot].rank
            reason_why = why(row, threshold, own) + (
                f"; limits doubled {doublings}x after its earlier hangs" if doublings else ""
            )
            body = {"host": slot[0], "local_rank": slot[1], "pid": pid, "rank": rank}
            if verdict == SUSPECT:
                state.suspected = pid
                reason = (
                    f"suspected: the others waited {max(waits):.1f}s for rank {rank} ({reason_why}); "
                    f"killed at {own.kill_s:.1f}s without progress"
                )
                seen.suspects.append({**body, "reason": reason, "kill_at_s": own.kill_s})
                continue
            first = killed is None or killed[0] != pid
            state.killed = (pid, now)
            reason = f"hung: the others waited {max(waits):.1f}s for rank {rank} ({reason_why})"
            stalled = (row.stalled_s or 0.0) >= own.kill_s  # not a busy rank past the upper bound
            if first and stalled and doublings < MAX_DOUBLINGS and own.kill_s < limits.upper_s:
                job.hang_doublings[slot_key(slot)] = [doublings + 1, pid]
                seen.job_changed = True
                reason += f"; its slot's next limits double (killed at {limits.doubled(doublings + 1).kill_s:.0f}s)"
            event = {"host": slot[0], "local_rank": slot[1], "pid": pid, "reason": reason, "dump_stack": True}
            seen.kills.append(Kill(event, rank, first=first, waited_s=max(waits)))

    def longest_wait(self, job: Job, now: float) -> float | None:
        """How long the live rank waiting longest in a collective has waited by `now` (0: none waits; None: no live
        rank reports): a fault found now stopped training that long ago (the goodput ledger's fault instant). A wait
        counts only when it had lasted at least as long as its report is old: a short one reported a while ago (a
        step's ordinary wait) has most likely ended since."""
        longest, known = 0.0, False
        for slot, state in self._slots.items():
            if not self._live(job, slot, now):
                continue
            known = True
            age, waiting = now - state.received_at, state.row.waiting_s
            if waiting is not None and waiting >= age:
                longest = max(longest, state.row.aged(age).waiting_s or 0.0)
        return longest if known else None

    def _waiting_for(self, job: Job, suspect: Slot, threshold: float, now: float) -> list[float]:
        """How long each other slot that waits at least `threshold` has waited by `now` (its wait goes on since its
        last report; the long waiters no longer live leave the index)."""
        waiting = []
        for other in list(self._long_waiters):
            if not self._live(job, other, now):
                del self._long_waiters[other]
                continue
            state = self._slots[other]
            waited = state.row.aged(now - state.received_at).waiting_s or 0.0
            if other != suspect and waited >= threshold:
                waiting.append(waited)
        return waiting


def _declared(row: WaitRow) -> dict[str, Any] | None:
    """A slot inside a wait it declared: why, and the seconds left."""
    return None if row.declared_s is None else {"reason": row.declared, "left_s": round(row.declared_s, 1)}


def _stopped(row: WaitRow) -> dict[str, Any] | None:
    """A slot stopped inside a collective (a signal or a debugger): for how long."""
    return {"stopped_s": round(row.stalled_s or 0.0, 1)} if row.stopped else None


def _counts(job: Job, slot: Slot, row: WaitRow) -> bool:
    """Is `row` the report of the current round's worker of `slot`, which has not ended?"""
    report = job.reports.reports.get(slot)
    return row.round == job.round and report is not None and report.state in SILENT and report.pid == row.pid
