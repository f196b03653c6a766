"""Riding through a control-plane outage: one line when replies stop, one line when they come back, and the pace
of retries in between (0.25 s, doubling to at most 2 s)."""

from __future__ import annotations

import time
from collections.abc import Callable

from elastic_control_plane.elasticctl.control import ControlPlaneUnreachable

UNREACHABLE = "[elasticctl] control plane unreachable, retrying"
FIRST_RETRY = 0.25
LONGEST_RETRY = 2.0


def back_line(seconds: float) -> str:
    return f"[elasticctl] control plane reachable again after {seconds:.1f}s"


class Outage:
    """One command's view of whether the control plane answers; `say` gets the two lines, once per outage."""

    def __init__(self, say: Callable[[str], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._say = say
        self._clock = clock
        self._since: float | None = None
        self._next_retry = FIRST_RETRY

    def failed(self, error: ControlPlaneUnreachable, silent_since: float | None = None) -> float:
        """A request got no reply: say so if this starts an outage; return the seconds to wait before retrying.
        `silent_since`: when the service was last heard, if before the unanswered request was sent."""
        if self._since is None:
            self._since = error.silent_since if silent_since is None else min(silent_since, error.silent_since)
            self._next_retry = FIRST_RETRY
            self._say(f"{UNREACHABLE} (no reply from the {error.service} at {error.endpoint})")
        wait = self._next_retry
        self._next_retry = min(wait * 2, LONGEST_RETRY)
        return wait

    def answered(self) -> None:
        """A reply came: if it ends an outage, say how long it lasted."""
        if self._since is not None:
            self._say(back_line(self._clock() - self._since))
            self._since = None

    def lasted(self) -> float:
        """Seconds since the outage began (0 when there is none)."""
        return 0.0 if self._since is None else self._clock() - self._since
