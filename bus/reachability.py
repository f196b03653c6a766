"""When to say that a peer cannot be reached, and that it can again: pure bookkeeping, no sockets, no clock.

The caller reports each contact with the peer as it happens (`reached`) or
fails (`missed`), with the time. The first warning is due once nothing has
been heard for `warn_after` seconds (counted from the start, for a peer never
reached), the next ones at most every `repeat_every` seconds, however often
the caller retries. A contact after a warning is a recovery, which the caller
reports once. The agent uses one for its control plane, a worker one for its
agent.
"""

from __future__ import annotations

REPEAT_EVERY = 60.0


class Reachability:
    def __init__(self, warn_after: float, now: float, repeat_every: float = REPEAT_EVERY) -> None:
        self.warn_after = warn_after
        self.repeat_every = repeat_every
        self.last_contact = now
        self._warned_at: float | None = None

    def silent_for(self, now: float) -> float:
        """Seconds since the last contact (since the start, if there was none)."""
        return now - self.last_contact

    def missed(self, now: float) -> bool:
        """A contact failed at `now`: True when a warning is due now (the caller logs it)."""
        if self.silent_for(now) < self.warn_after:
            return False
        if self._warned_at is not None and now - self._warned_at < self.repeat_every:
            return False
        self._warned_at = now
        return True

    def reached(self, now: float) -> float | None:
        """A contact succeeded at `now`: the seconds of silence it ends when a warning was given for them
        (the caller logs the recovery), else None."""
        silent = self.silent_for(now) if self._warned_at is not None else None
        self.last_contact = now
        self._warned_at = None
        return silent
