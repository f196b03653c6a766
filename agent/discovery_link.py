"""The agent's link to discovery: register, heartbeat, slot and drain reports, and whether the control plane answers.

Paranoid Pirate: one register or heartbeat is in flight at a time, sent
again (the same request, answered once) every heartbeat interval until the
host would count as lost, so an overloaded discovery answers each once
instead of getting a new registration from every agent every second. A reply
of `unknown` means register again; `lost` means the host was declared lost:
the agent stops its workers (`HostSide.host_lost`) before registering afresh. An
unreachable control plane leaves the workers running while the link keeps
trying, with a warning naming where it tries (then one a minute) and one line
when discovery answers again.

Each registration and heartbeat carries the host's last health check (agent/host_health.py); a check that ends is
sent at once, and a reply's `check_health` asks for a new one (a number, nothing else is read from it); a reply's
`probe` asks for a collective probe (agent/collective_probe.py).

On Kubernetes (ELASTIC_POD_TOKEN_FILE, the chart's projected service-account token) each registration carries the
pod's token, read again every time (the kubelet rotates it), so that discovery takes the host's name only from its own
pod (services/discovery/pod_identity.py). The token is never logged. A refused registration is said once per reason.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from elastic_control_plane.agent.host_health import HostHealth
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.bus.client import AsyncClient
from elastic_control_plane.bus.config import Timing, unresolved_hosts
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.reachability import Reachability

POD_TOKEN_ENV = "ELASTIC_POD_TOKEN_FILE"


class HostSide(Protocol):
    """What the link reads of its host and tells it: the host's own report and down slots, sent with each heartbeat
    and registration, and that discovery declared the host lost."""

    def host_report(self) -> dict[str, Any]: ...

    def slots_down(self) -> dict[str, Any]: ...

    def host_lost(self) -> None: ...


class DiscoveryLink:
    def __init__(
        self,
        discovery: AsyncClient,
        host: str,
        slots: int,
        incarnation: str,
        timing: Timing,
        control_endpoints: list[str],
        side: HostSide,
        log: Any,
        health: HostHealth,
    ) -> None:
        self.discovery, self.host, self.slots, self.incarnation, self.timing = (
            discovery,
            host,
            slots,
            incarnation,
            timing,
        )
        self.control_endpoints = control_endpoints
        self.side, self.log, self.health = side, log, health
        self.control_plane = Reachability(timing.lost_after, time.monotonic())
        self.registered = False
        self.warm = False
        self._in_flight = False
        self._reported_warm = False
        self._reported_health: dict[str, Any] | None = None
        self._refused: str | None = None  # why the last registration was refused: said once
        self.pod_token_file = os.environ.get(POD_TOKEN_ENV) or None

    def beat(self) -> None:
        """Every heartbeat interval: register until registered, then heartbeat (never two at once)."""
        if self._in_flight:
            return
        self.health.due()
        if not self.registered:
            self.register()
            return
        self._ping("heartbeat", {}, self._on_heartbeat_reply)

    def register(self) -> None:
        """Register (the host's checks run first, or again: it is not available before they pass)."""
        self.health.start()
        body = {"slots": self.slots, **self.side.slots_down(), **self._pod_token()}
        self._ping("register", body, self._on_registered)

    def _pod_token(self) -> dict[str, str]:
        """The pod's token for a registration: read now, as it rotates; none where ELASTIC_POD_TOKEN_FILE is unset or
        cannot be read (said, with the file's name: discovery then refuses the registration)."""
        if self.pod_token_file is None:
            return {}
        try:
            return {"pod_token": Path(self.pod_token_file).read_text().strip()}
        except OSError as exc:
            self.log.warning("pod_token_unreadable", path=self.pod_token_file, reason=str(exc))
            return {}

    def become_warm(self) -> None:
        """Tell discovery at once that the host's workers are ready (if the last ping went out before they were)."""
        self.warm = True
        self._report_warmth()

    def health_checked(self) -> None:
        """A health check ended (the loop was woken): its result goes to discovery now."""
        if self.health.finished():
            self._report_warmth()

    def _report_warmth(self) -> None:
        """Send what discovery has not heard yet (the host became warm, a health check ended) with a heartbeat now."""
        unsent = self.warm and not self._reported_warm or self.health.report() != self._reported_health
        if unsent and self.registered and not self._in_flight:
            self.beat()

    def report_down(self, then: Callable[[], None] | None = None) -> None:
        """Send the slots down now; `then` runs once discovery has them (or could not be reached)."""
        self.discovery.send(
            "slots",
            {"host": self.host, "incarnation": self.incarnation, **self.side.slots_down()},
            on_reply=lambda _: then and then(),
            on_timeout=then,
            timeout=INTERVALS.slot_report_deadline / 2,
            deadline=INTERVALS.slot_report_deadline,
        )

    def drain(self, deadline: float) -> None:
        self.discovery.send("drain", {"host": self.host}, timeout=self.timing.request_timeout, deadline=deadline)

    def unregister(self, then: Callable[[], None]) -> None:
        """Leave discovery, then `then` (at once when not registered and nothing is in flight)."""
        if self.registered:
            self.registered = False
            self.discovery.send(
                "unregister",
                {"host": self.host, "incarnation": self.incarnation},
                on_reply=lambda _: then(),
                on_timeout=then,
                timeout=1.0,
                deadline=2.0,
            )
        elif not self.discovery.in_flight:
            then()

    def _ping(self, msg_type: str, body: dict[str, Any], on_reply: Callable[[Message], None]) -> None:
        self._in_flight = True
        self._reported_warm, self._reported_health = self.warm, self.health.report()
        self.discovery.send(
            msg_type,
            {
                "host": self.host,
                "incarnation": self.incarnation,
                "warm": self.warm,
                "health": self._reported_health,
                **self.side.host_report(),
                **body,
            },
            on_reply=on_reply,
            on_timeout=self._no_reply,
            timeout=self.timing.heartbeat,
            deadline=self.timing.lost_after,
        )

    def _on_registered(self, reply: Message) -> None:
        self._in_flight = False
        self._reached()
        if reply.error:
            if reply.body.get("message") != self._refused:
                self.log.warning("register_refused", code=reply.error, reason=reply.body.get("message"))
            self._refused = reply.body.get("message")
            return
        self._refused = None
        if not self.registered:
            self.log.info("registered")
        self.registered = True
        self.health.ask(reply.body.get("check_health"))
        self.health.ask_probe(reply.body.get("probe"))
        self._report_warmth()

    def _on_heartbeat_reply(self, reply: Message) -> None:
        self._in_flight = False
        self._reached()
        status = reply.body.get("status")
        if status == "lost":
            self.side.host_lost()
        if status in ("lost", "unknown"):
            self.registered = False
            self.register()
        else:
            self.health.ask(reply.body.get("check_health"))
            self.health.ask_probe(reply.body.get("probe"))
            self._report_warmth()

    def _no_reply(self) -> None:
        """No reply within a heartbeat: after a few in a row, a warning naming where the agent tries (then one a
        minute). Resolving the hosts blocks the loop while DNS answers, at most once a minute."""
        self._in_flight = False
        now = time.monotonic()
        if self.control_plane.missed(now):
            unresolved = unresolved_hosts(self.control_endpoints)
            self.log.warning(
                "control_plane_unreachable",
                endpoints=self.control_endpoints,
                silent_s=round(self.control_plane.silent_for(now), 1),
                reason="; ".join(f"{host} does not resolve" for host in unresolved) or "no reply",
                retrying_every_s=self.timing.heartbeat,
            )

    def _reached(self) -> None:
        silent = self.control_plane.reached(time.monotonic())
        if silent is not None:
            self.log.warning("control_plane_reachable", endpoint=self.discovery.endpoint, silent_s=round(silent, 1))
