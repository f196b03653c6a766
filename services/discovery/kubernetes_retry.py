"""When the Kubernetes client (services/discovery/kubernetes.py) tries again after a failure, and what it says: the
retry policy of client-go's reflector, apart from the HTTP.

- A back-off with jitter: each failure in a row doubles the step from `RetryPolicy.first` up to `cap`, and each
  wait is drawn within ±`jitter` of its step and below the cap, so that clients that failed together do not come
  back together. A watch that brings something starts it again from `first`.
- A Retry-After (on a 429 or a 5xx) is waited instead of the step, up to the cap: a longer one is capped (the
  client says so).
- A watch that fails is tried again from the last resourceVersion; after `rewatches` failures in a row the client
  lists again. A 401, a 403 or a 429 never leads to a list: a list would get the same answer.
- Each kind of trouble has its log event (`failure_event`), said once while it lasts.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from elastic_control_plane.services.discovery.pods import Forbidden, Unauthorized, Unavailable

TOO_MANY_REQUESTS = 429
BAD_ANSWERS = (ValueError, KeyError, TypeError, AttributeError)  # not the JSON of a PodList or a watch event


@dataclass(frozen=True)
class RetryPolicy:
    """Seconds between tries after failures in a row: `first`, doubling up to `cap`, each within ±`jitter` (a
    fraction) of its step; `rewatches` failed watches in a row make the client list again."""

    first: float = 0.8
    cap: float = 30.0
    jitter: float = 0.5
    rewatches: int = 3


class Backoff:
    """The waits of one client: `wait()` after each failure, `reset()` after a success."""

    def __init__(self, policy: RetryPolicy | None = None, rng: random.Random | None = None) -> None:
        self.policy = policy or RetryPolicy()
        self._rng = rng or random.Random()
        self._step = self.policy.first

    def reset(self) -> None:
        self._step = self.policy.first

    def wait(self, retry_after: float | None = None) -> float:
        """The seconds to wait before the next try: `retry_after` up to the cap where the API asked for it, else the
        step with jitter. The step doubles either way."""
        step, self._step = self._step, min(self.policy.cap, self._step * 2)
        if retry_after is not None:
            return min(retry_after, self.policy.cap)
        low, high = step * (1 - self.policy.jitter), min(self.policy.cap, step * (1 + self.policy.jitter))
        return self._rng.uniform(low, high)  # drawn below the cap, not clamped to it: no two waits the same there


def retry_after_seconds(header: str | None, now: float | None = None) -> float | None:
    """A Retry-After header's seconds (a number of seconds, or an HTTP date); None for none, or none positive."""
    if not header:
        return None
    text = header.strip()
    if text.isdigit():
        seconds = float(text)
    else:
        try:
            seconds = parsedate_to_datetime(text).timestamp() - (time.time() if now is None else now)
        except (TypeError, ValueError):
            return None
    return seconds if seconds > 0 else None


def failure_event(exc: Exception) -> str:
    """The log event that says this failure."""
    if isinstance(exc, Unauthorized):
        return "kubernetes_unauthorized"
    if isinstance(exc, Forbidden):
        return "kubernetes_forbidden"
    if isinstance(exc, Unavailable):
        return "kubernetes_throttled" if exc.status == TOO_MANY_REQUESTS else "kubernetes_unavailable"
    if isinstance(exc, BAD_ANSWERS):
        return "kubernetes_bad_answer"
    return "kubernetes_unreachable"


def leads_to_relist(exc: Exception) -> bool:
    """Whether a watch failing so counts towards a list: not when the API refused the credentials, the verb, or
    asked for fewer requests."""
    if isinstance(exc, Unavailable):
        return exc.status != TOO_MANY_REQUESTS
    return not isinstance(exc, (Unauthorized, Forbidden))
