"""The hang limits and the judgement of one worker's row: when a rank the others wait for is suspected, when it is
hung, and how the limits grow for a slot that hung before (pure rules; services/registry/waits.py applies them).

The limits (`limits_of`). A wait with no progress anywhere in a rank's process tree looks exactly like a deadlock;
only time tells them apart, so the limits start above a floor that ordinary pauses stay under (a sleep, a lock, a
slow read, a child that waits: up to 30 s, at any point of a job). `limit` is MARGIN times the longest wait and the
typical time between waits any report of the job showed (the maxima kept in `Job.wait_calibration`, saved with
the job), at least FLOOR_S and at most the job's `hung_timeout`, which is `upper`; `kill` is KILL_FACTOR times
`limit`, at most `upper`. A slot is judged (`stage`) when it is not waiting, is not inside a wait it declared (the
agent reports none of its busy time until the declaration ends) and has been busy: for `upper` it is HUNG whatever
it did (it computes or writes: a checkpoint save or a first compile is no hang before the explicit bound); past
the first IGNORED_WAITS waits of its round (they wait for ranks that restore, load or compile), with no progress of
its process tree for `limit` it is SUSPECT, for `kill` it is HUNG. Each slot killed for no
progress has its later limits doubled (`Job.hang_doublings`, saved with the job, at most MAX_DOUBLINGS, never past
`upper`; `doublings_for`): a rank that hangs again at the same place after its restart (a first batch slower than
the limit in every life) is given longer, not crash-looped; its worker doing RECOVERED_WAITS waits in one round
clears it.

A slot under judgement (`judged`: busy, or inside a wait it declared) bounds the others' wait for it, so the
registry excuses them from the collective timeout (services/registry/waits.py).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass

from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.registry.job import RUNNING_JOB, Job
from elastic_control_plane.services.registry.reports import Slot
from elastic_control_plane.services.registry.wait_rows import WaitRow
from elastic_control_plane.slot_processes.wait_record import IGNORED_WAITS

FLOOR_S = 30.0  # ordinary pauses with no progress (a sleep, a lock, a child that waits) stay under it
MARGIN = 5.0  # NVRx's margin over the longest wait seen
KILL_FACTOR = 4.0 / 3.0  # suspected at the limit, killed at this multiple of it (40 s at the floor)
MAX_DOUBLINGS = 4
RECOVERED_WAITS = 1000
CALIBRATION = ("longest_wait_s", "typical_busy_s")
SUSPECT, HUNG = "suspect", "hung"


@dataclass(frozen=True)
class Limits:
    limit_s: float  # suspected after this long without progress
    kill_s: float  # killed after this long without progress
    upper_s: float  # killed after this long busy, whatever it did (the job's hung timeout)

    def to_wire(self) -> dict[str, float]:
        return {"limit_s": self.limit_s, "kill_s": self.kill_s, "upper_s": self.upper_s}

    def doubled(self, times: int) -> Limits:
        """The limits of a slot killed as hung `times` times: each doubled, never past the upper bound."""
        factor = 2**times
        return Limits(min(self.upper_s, factor * self.limit_s), min(self.upper_s, factor * self.kill_s), self.upper_s)


NO_LIMITS = {"limit_s": None, "kill_s": None, "upper_s": None}  # the limits told while no running job detects hangs


def limits_of(spec: JobSpec, calibration: MutableMapping[str, float]) -> Limits:
    calibrated = MARGIN * max(calibration.get(name, 0.0) for name in CALIBRATION)
    limit = min(spec.hung_timeout, max(FLOOR_S, calibrated))
    return Limits(limit, min(spec.hung_timeout, KILL_FACTOR * limit), spec.hung_timeout)


def judged_limits(job: Job) -> Limits | None:
    """The limits the job's hangs are judged by; None unless it runs and detects hangs."""
    spec = judged_spec(job)
    return None if spec is None else limits_of(spec, job.wait_calibration)


def judged_spec(job: Job) -> JobSpec | None:
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


def judged(row: WaitRow) -> bool:
    """Is the slot under judgement: busy (bounded by the upper bound at least), or inside a wait it declared?"""
    return row.waiting_s is None and (row.declared_s is not None or row.busy_s is not None)


def stage(row: WaitRow, limits: Limits) -> tuple[str, float] | None:
    """(SUSPECT or HUNG, how long the others must wait for it) for a slot that may hang the others; None when it is
    none. Busy for the upper bound, it is HUNG even in its round's first waits."""
    if row.waiting_s is not None or row.busy_s is None or row.declared_s is not None:
        return None
    if row.busy_s >= limits.upper_s:
        return HUNG, limits.upper_s
    if row.waits < IGNORED_WAITS:
        return None
    stalled = row.stalled_s or 0.0  # never more than busy_s: it counts from the busy stretch's start at the most
    if stalled >= limits.kill_s:
        return HUNG, limits.kill_s
    if stalled >= limits.limit_s:
        return SUSPECT, limits.limit_s
    return None


def slot_key(slot: Slot) -> str:
    """A slot as a key of `Job.hang_doublings`."""
    return f"{slot[0]}:{slot[1]}"


def doublings_for(job: Job, slot: Slot, pid: int) -> int:
    """How many times the limits of the slot's worker `pid` are doubled: the slot's count, less the doubling its own
    kill made (it applies to the worker that replaces it)."""
    times, killed_pid = job.hang_doublings.get(slot_key(slot), (0, 0))
    return times - 1 if pid == killed_pid else times


def why(row: WaitRow, threshold: float, limits: Limits) -> str:
    if threshold == limits.upper_s and (row.stalled_s or 0.0) < threshold:
        return f"upper bound {limits.upper_s:g}s, busy for {row.busy_s or 0.0:.1f}s"
    if row.stopped:
        stopped = row.stalled_s or 0.0
        return f"limit {threshold:.1f}s, stopped inside a collective (by a signal or a debugger) for {stopped:.1f}s"
    return f"limit {threshold:.1f}s, no progress in its process tree for {row.stalled_s or 0.0:.1f}s"
