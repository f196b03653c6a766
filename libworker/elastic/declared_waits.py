"""`waiting(reason, up_to=S)`: a rank tells its agent that it is busy outside the collectives for good reason (a
shard downloading, a subprocess preparing data, a lock another job holds) for up to S seconds. The agent reports
it, `elasticctl status` shows it, and no hang is judged while it lasts; the others keep waiting for this rank past
the collective timeout. When it ends (or S runs out) the rank's busy time counts again from then.

    with elastic.waiting("fetching the next shard", up_to=600):
        fetch_shard()

    @elastic.waiting("preprocessing", up_to=300)
    def preprocess(): ...

Written into the worker's wait record (slot_processes/wait_record.py): no message, no system call. Outside a job
started by an agent it does nothing.
"""

from __future__ import annotations

import contextlib
import math

from libworker.world import world


class waiting(contextlib.ContextDecorator):  # noqa: N801 - a context manager used like a function, as contextlib's
    """Declare a wait of up to `up_to` seconds, for `reason` (shown in `elasticctl status`)."""

    def __init__(self, reason: str, up_to: float) -> None:
        if not isinstance(reason, str) or not reason.strip():
            raise ValueError("waiting(reason, up_to): reason must be a non-empty string")
        if isinstance(up_to, bool) or not isinstance(up_to, (int, float)) or not math.isfinite(up_to) or up_to <= 0:
            raise ValueError(f"waiting(reason, up_to): up_to must be a positive number of seconds, not {up_to!r}")
        self.reason, self.up_to = reason.strip(), float(up_to)

    def __enter__(self) -> waiting:
        world.waits.declare(self.reason, self.up_to)
        return self

    def __exit__(self, *exc: object) -> None:
        world.waits.end_declared()
