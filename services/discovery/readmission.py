"""The discovery service's part in readmitting hosts (a mixin of services/discovery/service.py's DiscoveryService):
the agents' health reports, the rechecks asked in heartbeat replies, probation's forgiven counts, and the
operator's `uncordon`.

- register / heartbeat {..., health}: the agent's last health check (services/discovery/bodies.py `health`); a host
  held by it is not available (state `unhealthy`, admission.py). A heartbeat's reply carries `check_health: N` while
  the host waits for a recheck its agent has not answered yet; the agent runs its checks and reports `request: N`.
  Nothing in a reply names a command: the agent's checks are its own command line's.
- a host whose cooldown ends is asked for a recheck, so it re-enters only once a check begun after the cooldown
  passed.
- uncordon {host} -> {host, state}: the operator clears a host's blacklist, cooldown and count (kept with the marks,
  services/discovery/marks_log.py); it still enters only after a fresh check passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic_control_plane.bus.roles import OPERATOR
from elastic_control_plane.bus.service import Request, RequestError, handles
from elastic_control_plane.services.discovery import bodies, probation
from elastic_control_plane.services.discovery.admission import health_hold
from elastic_control_plane.services.discovery.hostset import HostRecord, HostSet
from elastic_control_plane.services.discovery.marks_log import MarksLog, marks_saved

SWEEP_INTERVAL = 1.0  # seconds between two looks at the hosts on probation


class Readmission:
    hostset: HostSet
    marks_log: MarksLog | None
    probation: probation.Probation
    log: Any
    clock: Callable[[], float]
    _changed: Callable[[], None]  # the service's: the host set changed
    _known: Callable[[Request], str]  # the service's: the request's host, known, else unknown_host
    _take_probe: Callable[[str, dict[str, Any] | None], dict[str, Any]]  # services/discovery/collective_probe.py
    _swept_at: float = float("-inf")

    def _checked_health(self, body: dict[str, Any], record: HostRecord | None) -> dict[str, Any] | None:
        """The body's health report, checked unless it repeats the host's last one (most heartbeats do)."""
        if record is not None and body.get("health") == record.health:
            return record.health
        return bodies.health(body)

    def _take_health(self, host: str, health: dict[str, Any] | None) -> dict[str, Any]:
        """Keep `host`'s health report; what the agent is asked in reply (a recheck, a collective probe, or nothing)."""
        record = self.hostset.hosts[host]
        held = health_hold(record.health, record.health_wanted)
        record.health = health
        now_held = health_hold(health, record.health_wanted)
        if now_held != held:
            self.log.info("host_health", host=host, ok=now_held is None, hold=now_held)
            self._changed()
        asked = self._take_probe(host, health)
        if health is not None and health["request"] < record.health_wanted:
            asked["check_health"] = record.health_wanted
        return asked

    def _readmit(self, now: float, lifted: list[str]) -> None:
        """Hosts whose cooldown ended are asked for a recheck; once a second, probation forgives the counts of the
        hosts that ran clean long enough."""
        for host in lifted:
            probation.ask_recheck(self.hostset, host)
        if now - self._swept_at < SWEEP_INTERVAL:
            return
        self._swept_at = now
        forgiven = self.probation.sweep(self.hostset, now)
        if forgiven:
            self.log.info("probation_passed", hosts=forgiven, clean_s=self.probation.clean_window)
            try:
                with marks_saved(self.hostset, self.marks_log, self.clock):
                    pass
            except RequestError as exc:  # saved again with the next change of the marks
                self.log.warning("probation_not_saved", reason=exc.message)

    @handles("uncordon", roles=(OPERATOR,))
    def on_uncordon(self, request: Request) -> dict[str, Any]:
        host = self._known(request)
        with marks_saved(self.hostset, self.marks_log, self.clock):
            probation.uncordon(self.hostset, host)
        self.log.info("host_uncordoned", host=host)
        self._changed()
        return {"host": host, "state": self.hostset.state(self.hostset.hosts[host])}
