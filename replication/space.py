"""etcd's space when it refuses writes for it (NOSPACE): this process reclaims it (`EtcdClient.reclaim_space`: compact,
defragment every member, disarm the alarm), any replica whatever its state (replication/election.py), and bounded:
after a reclaim that freed less than RECLAIM_FREES_AT_LEAST of the backend (etcd full of live data, where another
would only stall every member again for nothing), none for RECLAIM_BACKOFF_S, said once (`etcd_full_of_live_data`:
the quota is too small for the job)."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from elastic_control_plane.replication.etcd import EtcdClient

RECLAIM_FREES_AT_LEAST = 0.05
RECLAIM_BACKOFF_S = 60.0


class SpaceReclaims:
    """This process's reclaims of etcd's space (`EtcdClient.reclaim_space`: compact, defragment every member, disarm),
    bounded: after one that freed less than RECLAIM_FREES_AT_LEAST of the backend (etcd full of live data, where
    another would only stall every member again for nothing), none for RECLAIM_BACKOFF_S, said once."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.futile_at: float | None = None

    def reclaim(self, client: EtcdClient, log: structlog.stdlib.BoundLogger) -> bool:
        """Reclaim now if allowed (True), else False (the refused write is an outage until the backoff ends).
        EtcdError when a step of the reclaim fails."""
        if self.futile_at is not None and self.clock() - self.futile_at < RECLAIM_BACKOFF_S:
            return False
        before, after = client.reclaim_space()
        log.warning("etcd_space_reclaimed", backend_bytes_before=before, backend_bytes_after=after)
        if before and (before - after) < RECLAIM_FREES_AT_LEAST * before:
            self.futile_at = self.clock()
            log.error(
                "etcd_full_of_live_data",
                backend_bytes=after,
                effect=f"no reclaim for {RECLAIM_BACKOFF_S:g} s: raise etcd's --quota-backend-bytes",
            )
        else:
            self.futile_at = None
        return True


RECLAIMS = SpaceReclaims()
