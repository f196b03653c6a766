"""Rounds and parked joins, as pure state: which join requests are answered, and with what.

A join is `(host, local_rank)` asking for a round newer than `after_round`. It is
answered when the latest round is newer, not yet released, and every slot of
that round has a join parked: then all are released together with their
SlotInfo. A join whose slot is not in the latest (newer) round is told it was
removed, unless it comes from a process that was never in a round (a
replacement or a warming host's worker, `after_round` 0): that one waits for a
round that has its slot. A released round admits no late joiner: it waits for
the next round. A round may be replaced before it is released (the host set
changed while it formed): a join for it (parked then, or arriving later)
whose slot the new round lacks is told it was removed, as if the round had run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from elastic_control_plane.job.assignments import SlotInfo

Slot = tuple[str, int]


@dataclass
class Join:
    slot: Slot
    after_round: int
    pid: int
    ticket: Any
    called_to: int = 0  # the latest round, not yet released, that had this join's slot while it waited


@dataclass
class Round:
    number: int
    slots: dict[Slot, SlotInfo]
    hosts_timestamp: float
    released: bool = False
    pids: dict[Slot, int] = field(default_factory=dict)

    @property
    def hosts(self) -> list[str]:
        return list(dict.fromkeys(s.hostname for s in sorted(self.slots.values(), key=lambda s: s.rank)))

    @property
    def prefix(self) -> str:
        return f"round/{self.number}/"

    @functools.cached_property
    def snapshot_writers(self) -> frozenset[int]:
        """The ranks that write their host's snapshot at each commit: the lowest rank on each host."""
        lowest: dict[str, int] = {}
        for info in self.slots.values():
            lowest[info.hostname] = min(info.rank, lowest.get(info.hostname, info.rank))
        return frozenset(lowest.values())

    def answer(self, slot: Slot) -> dict[str, Any]:
        info = self.slots[slot]
        return {
            "round": self.number,
            "prefix": self.prefix,
            "hosts_timestamp": self.hosts_timestamp,
            "snapshot_writer": info.rank in self.snapshot_writers,
            **info.to_dict(),
        }


class Rounds:
    """The rounds and the parked joins. Each join is settled in O(1): the latest round counts the slots that have
    a join waiting for it, and is released when the count reaches its size; only a new (or restored) round looks at
    every parked join, once. The rejoins of the latest round (joins of its workers for the next one) are logged as
    they are parked, so a reader with a cursor gets only the new ones (`rejoins_since`)."""

    def __init__(self) -> None:
        self.rounds: dict[int, Round] = {}
        self.parked: dict[Slot, Join] = {}
        self.latest = 0
        self.state_hosts: list[str] = []  # the hosts of the latest round released: the job's state is on them
        self._waiting = 0  # slots of the latest round with a parked join that waits for it
        self._due: list[tuple[Any, dict[str, Any]]] = []
        # The rejoins of the latest round as (host, local_rank, pid, after_round), in the order they were parked (read
        # with a cursor: `rejoins_since`), and the (slot, pid) of each: a worker that parks again is logged once.
        self.rejoins: list[tuple[str, int, int, int]] = []
        self._rejoins_logged: set[tuple[Slot, int]] = set()

    @property
    def current(self) -> Round | None:
        return self.rounds.get(self.latest)

    def add_round(self, slots: list[SlotInfo], hosts_timestamp: float) -> Round:
        self.latest += 1
        new = Round(self.latest, {(s.hostname, s.local_rank): s for s in slots}, hosts_timestamp)
        self.rounds[new.number] = new
        for old in [n for n in self.rounds if n < new.number - 1]:
            del self.rounds[old]
        self._recount()
        self._restart_rejoins()
        return new

    def restore(
        self, number: int, slots: list[SlotInfo], hosts_timestamp: float, released: bool, pids: dict[Slot, int]
    ) -> Round:
        """Take back the job's current round after a restart (the registry keeps it): numbering goes on from it, a
        released round admits no joiner, and an unreleased one is completed by the joins its workers send again."""
        restored = Round(number, {(s.hostname, s.local_rank): s for s in slots}, hosts_timestamp, released, pids)
        self.rounds = {number: restored}
        self.latest = number
        if released:
            self.state_hosts = restored.hosts
        self._recount()
        self._restart_rejoins()
        return restored

    def park(self, join: Join) -> None:
        """Park a join; it replaces a join parked for the same slot."""
        previous = self.parked.get(join.slot)
        if previous is not None and self._counts(previous):
            self._waiting -= 1
        self.parked[join.slot] = join
        self._admit(join)
        self._log_rejoin(join)

    def _log_rejoin(self, join: Join) -> None:
        """Log `join` if it is a rejoin: its worker was in the latest round (or a later one) and asks for the next;
        once per (slot, pid), so the log never holds more than one entry per worker of the round."""
        key = (join.slot, join.pid)
        if 0 < self.latest <= join.after_round and key not in self._rejoins_logged:
            self._rejoins_logged.add(key)
            self.rejoins.append((*join.slot, join.pid, join.after_round))

    def _restart_rejoins(self) -> None:
        """A new latest round: the log starts again, with the joins already parked that are rejoins of it."""
        self.rejoins, self._rejoins_logged = [], set()
        for join in self.parked.values():
            self._log_rejoin(join)

    def rejoins_since(self, round_number: int, cursor: int) -> tuple[list[tuple[str, int, int, int]], int]:
        """The rejoins logged since `cursor` and the cursor after them. A cursor is one of round `round_number`'s
        log: for another round (the log was started again since) or past the log's end, the whole log."""
        if round_number != self.latest or not 0 <= cursor <= len(self.rejoins):
            cursor = 0
        return self.rejoins[cursor:], len(self.rejoins)

    def forget(self, slot: Slot, pid: int) -> Join | None:
        join = self.parked.get(slot)
        if join is None or join.pid != pid:
            return None
        if self._counts(join):
            self._waiting -= 1
        return self.parked.pop(slot)

    def settle(self) -> list[tuple[Any, dict[str, Any]]]:
        """Answers now due, as (ticket, reply body); the answered joins leave the parking lot."""
        current = self.current
        if current is not None and not current.released and self._waiting == len(current.slots):
            current.released = True
            self.state_hosts = current.hosts
            self._waiting = 0
            for slot in current.slots:
                join = self.parked.pop(slot)
                current.pids[slot] = join.pid
                self._due.append((join.ticket, current.answer(slot)))
        due, self._due = self._due, []
        return due

    def _counts(self, join: Join) -> bool:
        """Whether `join` is counted as waiting for the latest round: it has a slot there and was in no later one."""
        current = self.current
        return (
            current is not None
            and not current.released
            and join.slot in current.slots
            and join.after_round < current.number
        )

    def _admit(self, join: Join) -> None:
        """Count a newly parked join, or answer it at once when the latest (unreleased) round removed its slot."""
        current = self.current
        if current is None or current.released:
            return
        if join.slot in current.slots:
            join.called_to = current.number
            if join.after_round < current.number:
                self._waiting += 1
        elif 0 < join.after_round < current.number or 0 < join.called_to < current.number or self._replaced_had(join):
            del self.parked[join.slot]
            self._due.append((join.ticket, {"removed": True, "round": current.number}))

    def _replaced_had(self, join: Join) -> bool:
        """Whether the round before the latest was replaced unreleased with `join`'s slot in it: the join would have
        been called to it (a worker of a host that was drained while the round formed, joining late)."""
        replaced = self.rounds.get(self.latest - 1)
        return (
            replaced is not None
            and not replaced.released
            and join.slot in replaced.slots
            and join.after_round < replaced.number
        )

    def _recount(self) -> None:
        """A new latest round: every parked join is counted or answered again, once."""
        self._waiting = 0
        for join in list(self.parked.values()):
            self._admit(join)
