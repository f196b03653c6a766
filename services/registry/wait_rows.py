"""The `waits` report at the registry's door: one row per worker, as its agent saw it (agent/wait_watch.py), parsed
into `WaitRow`s, and the host's newest commit (`CommitReport`), or refused with a `bad_request` error naming the
first field that is wrong."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from elastic_control_plane.bus.service import RequestError
from elastic_control_plane.bus.service import field as body_field


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
    declared_s: float | None = None  # seconds left of the wait it declared, None outside one
    declared: str | None = None  # the reason it declared
    stopped: bool = False  # seen stopped (a signal or a tracer) inside a collective: stalled since then

    @property
    def waited_s(self) -> float:
        """Seconds waited over the worker's life, the wait under way included."""
        return self.waited_total_s + (self.waiting_s or 0.0)

    def aged(self, seconds: float) -> WaitRow:
        """The row as it stands `seconds` after it was sent, when nothing changed since: a wait, a busy stretch and a
        stall under way go on (a row still counts only while fresh, so the guess is never long); a declared wait
        only runs down (its end begins a busy stretch the agent reports)."""
        if seconds <= 0:
            return self
        if self.declared_s is not None:
            return replace(self, declared_s=max(0.0, self.declared_s - seconds))
        return replace(
            self,
            waiting_s=None if self.waiting_s is None else self.waiting_s + seconds,
            busy_s=None if self.busy_s is None else self.busy_s + seconds,
            stalled_s=None if self.stalled_s is None else self.stalled_s + seconds,
        )


@dataclass(frozen=True)
class CommitReport:
    """The host's newest commit, sent with its `waits` (agent/snapshots.py `commit_report`), for the goodput ledger."""

    commit: int  # 0: none yet
    age_s: float | None  # how long ago it was made (None: none yet)
    saving_s: float  # seconds the host's snapshot writer spent saving commits in this job
    resumed_round: int = 0  # the round its state was last synced in: training resumed (0: none yet)
    resumed_age_s: float | None = None  # how long ago


def parse_commit(body: dict[str, Any]) -> CommitReport | None:
    """The `commit` of a `waits` request (None: an agent that sends none); `bad_request` naming a wrong field."""
    item = body.get("commit")
    if item is None:
        return None
    if not isinstance(item, dict):
        raise RequestError("bad_request", "field 'commit' must be a map")
    return CommitReport(
        _count(item, "commit", "commit"),
        _seconds(item, "age_s", "commit", optional=True),
        _seconds(item, "saving_s", "commit"),
        _count(item, "resumed_round", "commit") if "resumed_round" in item else 0,
        _seconds(item, "resumed_age_s", "commit", optional=True),
    )


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
    spans = {
        name: _seconds(item, name, where, optional=True) for name in ("waiting_s", "busy_s", "stalled_s", "declared_s")
    }
    totals = {name: _seconds(item, name, where) for name in ("longest_wait_s", "typical_busy_s", "waited_total_s")}
    declared = item.get("declared")
    if declared is not None and not isinstance(declared, str):
        raise RequestError("bad_request", f"{where}.declared must be a string or null")
    stopped = item.get("stopped", False)
    if not isinstance(stopped, bool):
        raise RequestError("bad_request", f"{where}.stopped must be true or false")
    return WaitRow(**counts, **spans, **totals, declared=declared, stopped=stopped)


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
