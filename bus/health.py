"""What a process answers about its own health on its metrics port (bus/metrics.py `serve`), for probes:

- `/healthz` (liveness): 503 when the process's loop (bus/service.py `run`) last turned more than LOOP_STALL_S ago,
  naming how long ago; 200 otherwise, and while no loop runs (a replica standing by). A kubelet restarts a process
  whose loop is stuck; a slow request does not stall the loop this long.
- `/readyz` (readiness): 200 once the process says it is ready (`ready_when`: an agent, registered with discovery,
  its last health check passed and its workers' interpreter warm), else 503 with the reason; 200 for a process
  that sets no condition.

The loop's thread writes one float (`loop_turned`) and the HTTP thread reads it; a readiness condition is called from
the HTTP thread, so it must only read plain attributes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

LOOP_STALL_S = 60.0

_last_turn: float | None = None
_readiness: Callable[[], str | None] = lambda: None  # noqa: E731 (None: ready; else why not)


def loop_turned() -> None:
    global _last_turn
    _last_turn = time.monotonic()


def loop_stopped() -> None:
    global _last_turn
    _last_turn = None


def ready_when(condition: Callable[[], str | None]) -> None:
    """Readiness from now on: `condition()` returns None when ready, else why not."""
    global _readiness
    _readiness = condition


def liveness() -> str | None:
    """None while alive, else why not."""
    if _last_turn is None:
        return None
    stalled = time.monotonic() - _last_turn
    return f"the loop last turned {stalled:.0f} s ago" if stalled > LOOP_STALL_S else None


def readiness() -> str | None:
    return _readiness()


CHECKS: dict[str, Callable[[], str | None]] = {"/healthz": liveness, "/readyz": readiness}
