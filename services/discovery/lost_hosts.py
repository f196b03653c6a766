"""LostHosts: when discovery forgets a host that stopped answering, so that hosts coming and going for weeks leave
nothing behind.

A lost host stays listed (state `lost`, with how long) for FORGET_AFTER seconds, as long as any cooldown of a
blacklist it carries, so the registry and the operator see it, and a host that comes back within that time keeps
its marks; then its record goes. A host blacklisted for good (no cooldown) is kept: that decision must outlive it.
Each loss is one entry of a heap by the time it is due, so forgetting never scans the hosts.
"""

from __future__ import annotations

import heapq
from typing import Protocol

FORGET_AFTER = 600.0  # the longest default blacklist cooldown


class LostRecord(Protocol):
    lost_at: float | None
    blacklisted_until: float | None


class LostHosts:
    def __init__(self, forget_after: float = FORGET_AFTER) -> None:
        self.forget_after = forget_after
        self._due: list[tuple[float, str]] = []  # (when it may be forgotten, host), a heap; stale entries skipped

    def __len__(self) -> int:
        return len(self._due)

    def lost(self, name: str, now: float) -> None:
        heapq.heappush(self._due, (now + self.forget_after, name))

    def forget_due(self, hosts: dict[str, LostRecord], now: float) -> list[str]:
        """Remove from `hosts` the records lost for FORGET_AFTER seconds whose cooldown is over; return their names."""
        forgotten = []
        while self._due and self._due[0][0] <= now:
            _, name = heapq.heappop(self._due)
            record = hosts.get(name)
            if record is None or record.lost_at is None or record.lost_at + self.forget_after > now:
                continue  # back since, or lost again later (a newer entry is due then), or gone already
            until = record.blacklisted_until
            if until == float("inf"):
                continue
            if until is not None and until > now:
                heapq.heappush(self._due, (until, name))
                continue
            del hosts[name]
            forgotten.append(name)
        return forgotten
