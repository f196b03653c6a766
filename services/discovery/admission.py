"""When a known host may enter the job again: the blacklist's cooldown (exponential, with jitter) and the health
gate (its agent's last health check, and whether that check is fresh enough). Pure functions of plain values.

An agent reports `health {ok, reason, checked_at, request, next_check}` (services/discovery/bodies.py `health`):
`checked_at` is None while its first check runs; `request` is the highest recheck discovery had asked of it when
the check began. A host whose record wants a recheck numbered higher than `request` (its cooldown just ended, or an
operator uncordoned it) is held until a fresh result comes. An agent that sends no health report at all is not
gated.
"""

from __future__ import annotations

import random
from typing import Any


def cooldown(count: int, low: float, high: float, rng: random.Random) -> float:
    """Exponential backoff with jitter, like Horovod's blacklist cooldown: low * 2^(count-1), capped at high."""
    base = min(high, low * (2 ** max(0, count - 1)))
    return min(high, base * (1.0 + 0.25 * rng.random()))


def health_hold(health: dict[str, Any] | None, wanted: int) -> str | None:
    """Why the health gate holds a host back (None: it does not): `health` is its agent's last report, `wanted` the
    number of the recheck discovery asked of it last."""
    if health is None:
        return None
    if health["checked_at"] is None:
        return "first health check running"
    if not health["ok"]:
        return f"health check failed: {health['reason']}"
    if health["request"] < wanted:
        return "waiting for a fresh health check"
    return None
