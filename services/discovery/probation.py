"""Probation: how a host that failed earns its way back. Its blacklist count (which doubles each cooldown,
admission.py) is forgotten once the host has been available, without failing again, for `clean_window` seconds; a
host whose cooldown ended, or that an operator uncordoned, is admitted only after a fresh health check passed.

Pure bookkeeping on the HostSet's records, driven by the caller's clock (services/discovery/readmission.py wires it
into the service).
"""

from __future__ import annotations

from elastic_control_plane.services.discovery.hostset import ACTIVE, HostSet

DEFAULT_CLEAN_WINDOW = 600.0  # seconds a host runs clean before its blacklist count is forgotten


class Probation:
    def __init__(self, clean_window: float | None = DEFAULT_CLEAN_WINDOW) -> None:
        self.clean_window = clean_window  # None: a count is never forgotten (each cooldown longer until the cap)

    def sweep(self, hostset: HostSet, now: float) -> list[str]:
        """Start or stop each counted host's clean run by its state now; forget the count of those whose clean run
        reached `clean_window`; return them."""
        forgiven = []
        for record in hostset.hosts.values():
            if not record.blacklist_count:
                continue
            if hostset.state(record) != ACTIVE:
                record.clean_since = None
            elif record.clean_since is None:
                record.clean_since = now
            elif self.clean_window is not None and now - record.clean_since >= self.clean_window:
                record.blacklist_count, record.clean_since = 0, None
                forgiven.append(record.name)
        return forgiven

    def clean_left(self, clean_for: float | None) -> float | None:
        """Seconds until a host clean for `clean_for` seconds is forgiven (None: not on a clean run, or never)."""
        if clean_for is None or self.clean_window is None:
            return None
        return max(0.0, round(self.clean_window - clean_for, 3))


def ask_recheck(hostset: HostSet, name: str) -> None:
    """Hold `name` until its agent reports a health check begun after now (asked in its next heartbeat's reply)."""
    record = hostset.hosts.get(name)
    if record is not None:
        record.health_wanted += 1


def uncordon(hostset: HostSet, name: str) -> None:
    """The operator clears a host: its blacklist, cooldown and count end now, and it enters after a fresh check."""
    record = hostset.hosts[name]
    record.blacklisted_until, record.blacklist_count, record.clean_since = None, 0, None
    hostset.pending_marks.pop(name, None)
    ask_recheck(hostset, name)
