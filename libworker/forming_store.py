"""The store a gloo process group forms on: its waits end when the control plane aborts the round.

gloo connects every pair of ranks while its process group is built: each rank
publishes its address and waits, in the store, for every other's. A peer that
dies after it reached the round's store but before it published its address
leaves the others in that wait, which a TCPStore only ends at its timeout:
past the round's abort. This store polls instead, the pause growing from 1 ms
to POLL_MAX, and raises RoundFormationAborted as soon as `aborted()` is true;
torch passes the exception out of `init_process_group`. Since the abort ends
a wait for a dead peer, a wait lasts the longer of gloo's timeout (short while
the group forms: libworker.torch_compat.gloo_formation_timeout) and the
store's own (the collective timeout): a live peer slow to publish, on a loaded
host, is waited for.

Only gloo's group uses it: NCCL's communicators wait in the store for rank 0's
id alone, and rank 0 serves the store, so its death ends the wait already (and
NCCL's background threads must not call into Python).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

POLL_MAX = 0.02


class RoundFormationAborted(RuntimeError):
    """The control plane aborted the round while its process group formed."""


class AbortableStore(dist.Store):
    """`inner`, with waits that end at `aborted()` (or at the longer of the caller's timeout and inner's)."""

    def __init__(self, inner: dist.Store, aborted: Callable[[], bool]) -> None:
        super().__init__()
        self.inner, self.aborted = inner, aborted

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = max(timeout or self.inner.timeout, self.inner.timeout).total_seconds()
        deadline, pause = time.monotonic() + limit, 0.001
        while not self.inner.check(keys):
            if self.aborted():
                raise RoundFormationAborted(f"aborted while its process group formed (waiting for {keys})")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait for {keys} timed out after {limit:g}s")
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
