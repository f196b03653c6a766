"""HostSet: the pure bookkeeping of discovery, driven by an injected clock.

A host is *available* when its agent is live (registered, heartbeating) and warm (its workers, if it started some to
join a running job, are ready), it is not draining, not blacklisted, not held by the health gate (admission.py) or
the collective probe, and, if a discovery script is configured, the script lists it (slots: the smaller of the
script's and the agent's). The assignment order is the order in which hosts became available: surviving hosts keep
their place, a host that returns goes last, so rank 0 stays on the oldest. A host is lost when its agent falls
silent (`expire`) or its source says it is gone (`declare_lost`: a Slurm node DOWN).

A host's slots are numbered 0..slots-1 (its local ranks, its GPUs). The agent reports the slots it has taken *down*
(their worker crashed, its replacement not ready yet); an available host offers its other slots, so the job re-forms
without a crashed slot and gets it back, at the same local rank, once its replacement waits in `init()`.

A discovery that restarted knows nothing; the registry gives it back the drains and blacklists it held (`restore`):
a mark for a host that has not registered again yet waits for it. Hosts of the job's round that never register
again are recorded as lost (`record_missing`). A lost host is forgotten in time (services/discovery/lost_hosts.py).
"""

from __future__ import annotations

import heapq
import random
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from elastic_control_plane.services.discovery.admission import cooldown, health_hold
from elastic_control_plane.services.discovery.lost_hosts import LostHosts

SlotIds = tuple[int, ...]
ACTIVE, LOST, DRAINING, BLACKLISTED, UNLISTED, WARMING, UNHEALTHY = (
    "active",
    "lost",
    "draining",
    "blacklisted",
    "unlisted",
    "warming",
    "unhealthy",
)


@dataclass
class HostRecord:
    name: str
    slots: int
    incarnation: str
    last_seen: float
    lost_at: float | None = None
    lost_declared: bool = False  # lost on its source's word (a Slurm node DOWN), not for its silence
    draining: bool = False
    blacklist_count: int = 0
    blacklisted_until: float | None = None
    blacklist_reason: str = ""
    warm: bool = True
    down: frozenset[int] = field(default_factory=frozenset)
    down_version: int = 0
    snapshots: dict[str, dict[str, Any]] = field(default_factory=dict)
    fork_server: dict[str, str] | None = None  # its agent's last report: {"state", "reason"} (agent/fork_server.py)
    health: dict[str, Any] | None = None  # its agent's last health report (services/discovery/admission.py)
    health_wanted: int = 0  # the number of the last recheck asked of its agent
    clean_since: float | None = None  # on probation: available (not failed again) since then (probation.py)
    probe_hold: str | None = None  # why the collective probe holds it back (services/discovery/collective_probe.py)


@dataclass(frozen=True)
class Mark:
    """What a discovery held against a host: draining, blacklisted until `until` (this clock; inf: for good)."""

    draining: bool = False
    blacklisted: bool = False
    until: float = float("inf")
    count: int = 0
    reason: str = ""

    def apply(self, record: HostRecord) -> None:
        """Add the mark to a host's record; what the record holds already (a newer decision) is kept."""
        record.draining = record.draining or self.draining
        if self.blacklisted and record.blacklisted_until is None:
            record.blacklisted_until = self.until
        record.blacklist_count = max(record.blacklist_count, self.count)
        record.blacklist_reason = record.blacklist_reason or self.reason


@dataclass(frozen=True)
class HostsChange:
    added: bool
    removed: bool


def hosts_updated_body(
    timestamp: float,
    version: int,
    change: HostsChange,
    hosts: list[tuple[str, tuple[int, ...]]],
    diff: HostsDiff | None,
) -> dict[str, Any]:
    """The `hosts_updated` event: Horovod's flags, and the diff from the last list published (or the whole list)."""
    event: dict[str, Any] = {"timestamp": timestamp, "version": version, "added": change.added}
    event["removed"] = change.removed
    if diff is None:
        event["hosts"] = [[name, list(slots)] for name, slots in hosts]
    else:
        event["set"], event["remove"] = [[name, list(slots)] for name, slots in diff.set], diff.remove
    return event


class HostSet:
    def __init__(self, rng: random.Random | None = None) -> None:
        self.hosts: dict[str, HostRecord] = {}
        self.order: list[str] = []
        self.script_hosts: dict[str, int | None] | None = None
        self.cooldown_range: tuple[float, float] | None = (60.0, 600.0)
        self.pending_marks: dict[str, Mark] = {}
        self.held_places: set[str] = set()
        self._rng = rng or random.Random()
        self._by_silence: OrderedDict[str, None] = OrderedDict()  # live hosts, the longest silent first
        self._cooldowns: list[tuple[float, str]] = []  # (end, host) of blacklists, a heap; stale entries are skipped
        self.lost = LostHosts()  # when each lost host is forgotten (services/discovery/lost_hosts.py)

    def _heard(self, name: str) -> None:
        self._by_silence[name] = None
        self._by_silence.move_to_end(name)

    def _watch_cooldown(self, record: HostRecord) -> None:
        if record.blacklisted_until is not None and record.blacklisted_until != float("inf"):
            heapq.heappush(self._cooldowns, (record.blacklisted_until, record.name))

    # -- agents --------------------------------------------------------------------------------
    def register(
        self,
        name: str,
        slots: int,
        incarnation: str,
        now: float,
        warm: bool = True,
        down: Sequence[int] = (),
        down_version: int = 0,
    ) -> None:
        record = self.hosts.get(name)
        self._heard(name)
        if record is None:
            record = self.hosts[name] = HostRecord(
                name, slots, incarnation, now, warm=warm, down=frozenset(down), down_version=down_version
            )
            mark = self.pending_marks.pop(name, None)
            if mark is not None:
                mark.apply(record)
                self._watch_cooldown(record)
            return
        if record.incarnation != incarnation:
            record.down_version = -1
        record.slots, record.incarnation, record.last_seen, record.lost_at, record.warm = (
            slots,
            incarnation,
            now,
            None,
            warm,
        )
        self.set_down(name, incarnation, down, down_version)

    def set_down(self, name: str, incarnation: str, down: Sequence[int], version: int) -> str:
        """The agent's slots that are down; a report older than the newest one applied (a resend) is ignored."""
        record = self.hosts.get(name)
        if record is None or record.incarnation != incarnation:
            return "unknown"
        if version >= record.down_version:
            record.down, record.down_version = frozenset(down), version
        return "lost" if record.lost_at is not None else "ok"

    def heartbeat(self, name: str, incarnation: str, now: float, warm: bool = True) -> str:
        """'ok', or 'unknown' (register again), or 'lost' (stop your workers, then register again)."""
        record = self.hosts.get(name)
        if record is None or record.incarnation != incarnation:
            return "unknown"
        if record.lost_at is not None:
            return "lost"
        record.last_seen, record.warm = now, warm
        self._heard(name)
        return "ok"

    def unregister(self, name: str, incarnation: str) -> bool:
        record = self.hosts.get(name)
        if record is None or record.incarnation != incarnation:
            return False
        del self.hosts[name]
        self._by_silence.pop(name, None)
        return True

    def expire(self, now: float, lost_after: float) -> list[str]:
        """Mark hosts whose agent has been silent for `lost_after` as lost; return them. Looks only at the hosts
        silent longest, up to the first one heard from recently enough."""
        newly_lost = []
        while self._by_silence:
            record = self.hosts[next(iter(self._by_silence))]
            if now - record.last_seen <= lost_after:
                break
            self._mark_lost(record, now)
            newly_lost.append(record.name)
        return newly_lost

    def declare_lost(self, names: Iterable[str], now: float) -> list[str]:
        """Mark the live hosts of `names` lost now, as `expire` does (their source says they are gone: a Slurm node
        DOWN); return them."""
        newly_lost = [name for name in sorted(names) if name in self.hosts and self.hosts[name].lost_at is None]
        for name in newly_lost:
            self._mark_lost(self.hosts[name], now, declared=True)
        return newly_lost

    def _mark_lost(self, record: HostRecord, now: float, declared: bool = False) -> None:
        record.lost_at, record.lost_declared = now, declared
        self._by_silence.pop(record.name, None)
        self.lost.lost(record.name, now)

    def forgive_silence(self, now: float) -> None:
        """Discovery itself was not running: treat every live host as just heard from."""
        for name in self._by_silence:
            self.hosts[name].last_seen = now

    # -- operator and registry decisions -------------------------------------------------------
    def set_draining(self, name: str, draining: bool) -> None:
        self.hosts[name].draining = draining

    def blacklist(self, name: str, now: float, reason: str) -> float | None:
        """Blacklist a host; return when it may come back (None: never)."""
        record = self.hosts.get(name)
        if record is None:
            return None
        record.blacklist_count += 1
        record.blacklist_reason, record.clean_since = reason, None
        if self.cooldown_range is None:
            record.blacklisted_until = float("inf")
        else:
            record.blacklisted_until = now + cooldown(record.blacklist_count, *self.cooldown_range, self._rng)
            self._watch_cooldown(record)
        return None if record.blacklisted_until == float("inf") else record.blacklisted_until

    def restore(self, marks: dict[str, Mark], order: Sequence[str] = ()) -> None:
        """Marks given back after a restart: applied to a registered host now, to another when it registers; and
        the job's host order (`order` first, in that order), whichever host registers again first: their places
        are held until `record_missing`."""
        self.order = [*order, *(name for name in self.order if name not in order)]
        self.held_places = set(order)
        for name, mark in marks.items():
            if name in self.hosts:
                mark.apply(self.hosts[name])
                self._watch_cooldown(self.hosts[name])
            else:
                self.pending_marks[name] = mark

    def record_missing(self, expected: Sequence[tuple[str, Sequence[int]]], now: float) -> list[str]:
        """Hosts of the job's round that did not register again: lost, as if their heartbeats had stopped here."""
        self.held_places = set()
        missing = [name for name, _ in expected if name not in self.hosts]
        for name, slots in expected:
            if name in missing:
                self.hosts[name] = HostRecord(name, max(slots, default=0) + 1, "", now, lost_at=now)
                self.lost.lost(name, now)
        return missing

    def lift_cooldowns(self, now: float) -> list[str]:
        """End the blacklists whose cooldown is over; return their hosts."""
        lifted = []
        while self._cooldowns and self._cooldowns[0][0] <= now:
            _, name = heapq.heappop(self._cooldowns)
            record = self.hosts.get(name)
            if record is not None and record.blacklisted_until is not None and now >= record.blacklisted_until:
                record.blacklisted_until = None
                lifted.append(name)
        return lifted

    # -- what the job sees ---------------------------------------------------------------------
    def state(self, record: HostRecord) -> str:
        if record.lost_at is not None:
            return LOST
        if not record.warm:
            return WARMING
        if record.blacklisted_until is not None:
            return BLACKLISTED
        if record.draining:
            return DRAINING
        if health_hold(record.health, record.health_wanted) is not None:
            return UNHEALTHY
        if self.script_hosts is not None and record.name not in self.script_hosts:
            return UNLISTED
        return ACTIVE if record.probe_hold is None else UNHEALTHY

    def _slots(self, record: HostRecord) -> int:
        listed = self.script_hosts.get(record.name) if self.script_hosts is not None else None
        return record.slots if listed is None else min(listed, record.slots)

    def _usable(self, record: HostRecord) -> SlotIds:
        if not record.down:  # nearly every host, asked for on every `hosts` (the registry's, ten times a second)
            return tuple(range(self._slots(record)))
        return tuple(i for i in range(self._slots(record)) if i not in record.down)

    def available(self) -> list[tuple[str, SlotIds]]:
        """Available hosts with the ids of their usable slots, in assignment order; updates the order."""
        ready = {r.name: usable for r in self.hosts.values() if self.state(r) == ACTIVE and (usable := self._usable(r))}
        placed = set(self.order)
        self.order = [name for name in self.order if name in ready or name in self.held_places] + [
            name for name in ready if name not in placed
        ]
        return [(name, ready[name]) for name in self.order if name in ready]

    def describe(self, now: float, records: Sequence[HostRecord] | None = None) -> list[dict[str, Any]]:
        """A row per host (or per record of `records`), in assignment order."""
        position = {name: i for i, name in enumerate(self.order)}
        rows = []
        for record in sorted(
            self.hosts.values() if records is None else records,
            key=lambda r: (position.get(r.name, len(position)), r.name),
        ):
            rows.append(
                {
                    "host": record.name,
                    "slots": self._slots(record),
                    "down": sorted(record.down),
                    "incarnation": record.incarnation,
                    "state": self.state(record),
                    "draining": record.draining,
                    "lost_for": None if record.lost_at is None else round(now - record.lost_at, 3),
                    "cooldown_left": None
                    if record.blacklisted_until in (None, float("inf"))
                    else round(record.blacklisted_until - now, 3),
                    "blacklisted": record.blacklisted_until is not None,
                    "blacklist_reason": record.blacklist_reason,
                    "blacklist_count": record.blacklist_count,
                    "snapshot": record.snapshots.get("snapshot"),
                    "checkpoint": record.snapshots.get("checkpoint"),
                    "fork_server": record.fork_server,
                    "health": record.health,
                    "health_hold": health_hold(record.health, record.health_wanted) or record.probe_hold,
                    "clean_for": None if record.clean_since is None else round(now - record.clean_since, 3),
                }
            )
        return rows


def slot_ids(slots: int | Sequence[int]) -> SlotIds:
    """A host's usable slots as ids: a count n means all of 0..n-1."""
    return tuple(range(slots)) if isinstance(slots, int) else tuple(slots)


def effective(hosts: Sequence[tuple[str, int | Sequence[int]]], max_np: int | None) -> list[tuple[str, SlotIds]]:
    """The slots an assignment would use: hosts filled in order up to max_np; hosts that get nothing are left out."""
    used: list[tuple[str, SlotIds]] = []
    left = max_np if max_np is not None else float("inf")
    for name, slots in hosts:
        if left <= 0:
            break
        take = slot_ids(slots)[: int(min(len(slot_ids(slots)), left))]
        if take:
            used.append((name, take))
            left -= len(take)
    return used


def compare(
    before: Sequence[tuple[str, int | Sequence[int]]], after: Sequence[tuple[str, int | Sequence[int]]]
) -> HostsChange | None:
    """Horovod's check_update, per slot: a host or slot gone is a removal, a new host or slot an addition."""
    old = {name: set(slot_ids(slots)) for name, slots in before}
    new = {name: set(slot_ids(slots)) for name, slots in after}
    added = any(new[name] - old.get(name, set()) for name in new)
    removed = any(old[name] - new.get(name, set()) for name in old)
    if not added and not removed and list(old) == list(new):
        return None
    return HostsChange(added=added, removed=removed or (not added and list(old) != list(new)))


@dataclass(frozen=True)
class HostsDiff:
    """What turns one host list into the next: `remove` these names, then `set` these hosts' slot ids (a host
    already listed keeps its place, a new one goes last)."""

    set: list[tuple[str, SlotIds]]
    remove: list[str]


def hosts_diff(
    before: Sequence[tuple[str, Sequence[int]]], after: Sequence[tuple[str, Sequence[int]]]
) -> HostsDiff | None:
    """The diff from `before` to `after`, or None when applying it cannot give `after`'s order (a host that left
    and came back between the two moved to the end): then only the whole list says it."""
    old = {name: tuple(slots) for name, slots in before}
    new = {name: tuple(slots) for name, slots in after}
    diff = HostsDiff(
        set=[(name, slots) for name, slots in new.items() if old.get(name) != slots],
        remove=[name for name in old if name not in new],
    )
    return diff if [name for name, _ in apply_diff(before, diff)] == list(new) else None


def apply_diff(before: Sequence[tuple[str, Sequence[int]]], diff: HostsDiff) -> list[tuple[str, SlotIds]]:
    removed = set(diff.remove)
    hosts = {name: tuple(slots) for name, slots in before if name not in removed}
    for name, slots in diff.set:
        hosts[name] = tuple(slots)
    return list(hosts.items())
