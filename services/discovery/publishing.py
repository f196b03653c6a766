"""What discovery announces (a mixin of services/discovery/service.py's DiscoveryService): when the slots an
assignment would use change, `hosts_updated` through the notifier, coalesced within COALESCE_WINDOW and never while
discovery settles; `published` and `version` are what the last one announced (the service's module docstring says
what the event carries)."""

from __future__ import annotations

import time
from typing import Any

from elastic_control_plane.bus.contract import Event
from elastic_control_plane.bus.outbox import Outbox
from elastic_control_plane.services.discovery.hostset import HostSet, compare, effective, hosts_diff, hosts_updated_body

COALESCE_WINDOW = 0.05  # seconds: changes within it go out as one hosts_updated
LOGGED_HOSTS = 20  # a hosts_updated log line names at most this many hosts of each kind


class HostsPublishing:
    hostset: HostSet
    outbox: Outbox
    log: Any
    max_np: int | None
    settle_until: float | None
    published: list[tuple[str, tuple[int, ...]]]
    version: int
    timestamp: float
    _change_pending: bool

    def _changed(self) -> None:
        """The host set changed: it is published within COALESCE_WINDOW, with whatever else changes meanwhile."""
        self._change_pending = True

    def _set_published(self, hosts: list[tuple[str, tuple[int, ...]]]) -> None:
        """Take `hosts` as announced without an event: the next event's version skips one, so a subscriber that
        follows the diffs sees the gap and asks for the whole list."""
        self.published = hosts
        self.version += 1

    def _publish_change(self) -> None:
        if not self._change_pending or self.settle_until is not None:
            return
        now_used = effective(self.hostset.available(), self.max_np)
        change = compare(self.published, now_used)
        if change is None:
            return
        diff = hosts_diff(self.published, now_used)
        self.timestamp = max(time.time(), self.timestamp + 1e-6)
        self.version += 1
        self.published = now_used
        event = hosts_updated_body(self.timestamp, self.version, change, now_used, diff)
        self.log.info(
            "hosts_updated",
            version=self.version,
            added=change.added,
            removed=change.removed,
            hosts=len(now_used),
            whole=diff is None,
            set=[name for name, _ in diff.set[:LOGGED_HOSTS]] if diff else None,
            remove=diff.remove[:LOGGED_HOSTS] if diff else None,
        )
        self.outbox.put(Event.HOSTS_UPDATED, event)
        self.outbox.flush()
