"""MarksLog: discovery's decisions about hosts (drains, blacklists with their cooldowns) kept in etcd (`--store
etcd://...`), so an operator's drain that discovery acknowledged survives a failover before the registry read it.

Under `<prefix>/discovery/marks`: one JSON map {host: {draining, blacklisted,
until (wall-clock seconds, or null: for good), count, reason}}, the form the
registry's `restore` gives (services/discovery/bodies.py `marks`). Written,
fenced by the replica's role, with every drain, undrain, blacklist and
configure and before discovery answers (`marks_saved`: a change that could not
be written is undone); a replica that takes over starts from it, and then
keeps it over the (possibly older) marks of the registry's `restore`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from elastic_control_plane.bus.service import RequestError
from elastic_control_plane.replication.election import LostRole
from elastic_control_plane.replication.etcd import EtcdError, put_op
from elastic_control_plane.replication.replica import CorruptRecord, Replica
from elastic_control_plane.services.discovery.hostset import HostRecord, HostSet, Mark


class MarksLogError(RuntimeError):
    """The marks did not reach etcd (out of reach, or the role was lost): the request is refused."""


def raw_marks(records: Iterable[HostRecord], pending: dict[str, Mark], local_now: float) -> dict[str, dict[str, Any]]:
    """Every host's mark in the saved form: the marked hosts' records, and the marks of hosts not registered yet
    (`local_now`: discovery's clock, turned into wall-clock seconds here)."""
    wall_now = time.time()

    def wall(until: float) -> float | None:
        return None if until == float("inf") else round(wall_now + (until - local_now), 3)

    marks = {
        name: {
            "draining": mark.draining,
            "blacklisted": mark.blacklisted,
            "until": wall(mark.until),
            "count": mark.count,
            "reason": mark.reason,
        }
        for name, mark in pending.items()
    }
    for record in records:
        if record.draining or record.blacklist_count or record.blacklisted_until is not None:
            marks[record.name] = {
                "draining": record.draining,
                "blacklisted": record.blacklisted_until is not None,
                "until": None if record.blacklisted_until is None else wall(record.blacklisted_until),
                "count": record.blacklist_count,
                "reason": record.blacklist_reason,
            }
    return marks


class MarksLog:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._key = replica.key("discovery", "marks")

    def load(self) -> dict[str, Any]:
        found = self.replica.client.get(self._key)
        if found is None:
            return {}
        try:
            marks = json.loads(found.value)
        except ValueError as exc:
            raise CorruptRecord(self._key, f"not JSON: {exc}") from None
        if not isinstance(marks, dict):
            raise CorruptRecord(self._key, "not a map of host to mark")
        return marks

    def save(self, marks: dict[str, dict[str, Any]]) -> None:
        try:
            self.replica.leadership.write([put_op(self._key, json.dumps(marks, sort_keys=True).encode())])
        except (LostRole, EtcdError) as exc:
            raise MarksLogError(f"the host marks did not reach etcd: {exc}") from None


# A host's marks as they stand: (draining, blacklist count, blacklisted until, reason) per host, and the pending ones.
MarksNow = tuple[dict[str, tuple[bool, int, "float | None", str]], dict[str, Mark]]


def marks_now(hostset: HostSet) -> MarksNow:
    """Every host's marks as they stand (and the marks waiting for hosts not registered yet)."""
    records = {
        name: (r.draining, r.blacklist_count, r.blacklisted_until, r.blacklist_reason)
        for name, r in hostset.hosts.items()
    }
    return records, dict(hostset.pending_marks)


def put_back(hostset: HostSet, marks: MarksNow) -> None:
    """Undo every change of the marks since `marks_now` (a stale cooldown left in the heap is skipped)."""
    records, pending = marks
    for name, (draining, count, until, reason) in records.items():
        record = hostset.hosts.get(name)
        if record is not None:
            record.draining, record.blacklist_count, record.blacklisted_until, record.blacklist_reason = (
                draining,
                count,
                until,
                reason,
            )
    hostset.pending_marks = pending


@contextmanager
def marks_saved(hostset: HostSet, log: MarksLog | None, clock: Callable[[], float]) -> Iterator[None]:
    """A change of the hosts' marks (drain, undrain, blacklist, configure) made inside the block counts only once
    saved (with etcd): a refused save puts every mark back as it was and the request is answered `unavailable`, so a
    retry applies it once."""
    before = marks_now(hostset)
    yield
    if log is None:
        return
    try:
        log.save(raw_marks(hostset.hosts.values(), hostset.pending_marks, clock()))
    except MarksLogError as exc:
        put_back(hostset, before)
        raise RequestError("unavailable", str(exc)) from None
