"""The goodput ledger (services/registry/ledger.py) as the job saves it: instants of the registry's monotonic clock
as wall-clock seconds (which mean the same to the next registry), in two parts: the ledger (`to_saved`, with
`alive`: when it was saved) and its interruptions (`timeline_to_saved`, written only when one ends or a late
commit changes the last). Loaded again (`from_saved`), the time since `alive` (the registry was down) is PAUSED when
the job was in an interruption, and stays in its training bucket when it trained (training goes on through an
outage)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic_control_plane.services.registry.ledger import (
    BUCKETS,
    CAUSES,
    DETECTING,
    REFORMING,
    WAITING_FOR_HOSTS,
    Ledger,
    shown,
    wall,
)

PLAIN = tuple(  # the fields saved as they are
    "seconds bucket asked size round resumed_round largest short_slot_s most_short by_cause by_host commit "
    "commits_seen saving_s resume_bucket".split()
)
INSTANTS = ("since", "trained_since", "commit_at")
ROLLBACK_INSTANTS = ("start", "end", "commit_at")
AsWall = Callable[[float], float | None]


def timeline_to_saved(ledger: Ledger, as_wall: AsWall) -> list[dict[str, Any]]:
    return [shown(entry, as_wall) for entry in ledger.timeline]


def to_saved(ledger: Ledger, now: float, as_wall: AsWall) -> dict[str, Any]:
    """The ledger as saved at `now` (its timeline apart)."""
    saved = {name: getattr(ledger, name) for name in PLAIN}
    saved.update({name: wall(getattr(ledger, name), as_wall) for name in INSTANTS})
    saved["alive"] = wall(now, as_wall)
    saved["interruption"] = None if ledger.interruption is None else shown(ledger.interruption, as_wall)
    rollback = ledger.rollback
    saved["rollback"] = (
        None
        if rollback is None
        else {**rollback, **{name: wall(rollback[name], as_wall) for name in ROLLBACK_INSTANTS}}
    )
    return saved


def from_saved(
    saved: dict[str, Any] | None, timeline: list[dict[str, Any]] | None, now: float, as_local: AsWall
) -> Ledger:
    """What `to_saved` and `timeline_to_saved` made, loaded at `now`."""
    ledger = Ledger()
    ledger.changed = False
    if not saved:
        return ledger  # no job, or one an earlier registry saved without a ledger: nothing is counted
    for name in PLAIN:
        if name in saved:
            setattr(ledger, name, saved[name])
    for name in INSTANTS:
        setattr(ledger, name, _local(saved.get(name), as_local))
    ledger.seconds = {**dict.fromkeys(BUCKETS, 0.0), **ledger.seconds}
    ledger.by_cause = {**dict.fromkeys(CAUSES, 0.0), **ledger.by_cause}
    interruption = saved.get("interruption")
    ledger.interruption = None if interruption is None else _loaded(interruption, as_local)
    ledger.timeline = [_loaded(entry, as_local) for entry in timeline or []]
    rollback = saved.get("rollback")
    if rollback is not None:
        ledger.rollback = {**rollback, **{name: _local(rollback[name], as_local) for name in ROLLBACK_INSTANTS}}
    ledger.timeline_changed = False
    alive = _local(saved.get("alive"), as_local)
    if ledger.bucket in (DETECTING, REFORMING, WAITING_FOR_HOSTS) and alive < now:
        ledger.control_plane(alive, available=False)
    return ledger


def _local(instant: float | None, as_local: AsWall) -> float:
    return -float("inf") if instant is None else as_local(instant) or 0.0


def _loaded(entry: dict[str, Any], as_local: AsWall) -> dict[str, Any]:
    return {**entry, "at": _local(entry["at"], as_local)}
