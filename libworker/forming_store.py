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

It is a whole Store: torch calls any method of the interface on the store a
group was made with (a process set's group is built on it later, through the
default group's PrefixStore), and a method a Python subclass lacks fails in
C++ with "Not implemented". Every method either delegates to `inner` or, when
it blocks (get, wait, multi_get, barrier, a blocking queue_pop), waits as
`wait` does. tests/unit/test_store_interface.py lists the interface from torch
itself, so a method a later torch adds fails that test until it is here.

A Python Store lives only as long as its Python object: C++ holds the object
torch made, whose overrides vanish with the Python side. Whoever forms a group
on one keeps a reference as long as the group may use it (libworker.world
holds the round's).

Only gloo's group uses it: NCCL's communicators wait in the store for rank 0's
id alone, and rank 0 serves the store, so its death ends the wait already (and
NCCL's background threads must not call into Python).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
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
        self.clones: list[AbortableStore] = []  # kept alive while this store is (see the module docstring)
        dist.Store.set_timeout(self, inner.timeout)

    def _wait_until(self, ready: Callable[[], bool], what: str, timeout: timedelta | None = None) -> None:
        limit = max(timeout or self.inner.timeout, self.inner.timeout).total_seconds()
        deadline, pause = time.monotonic() + limit, 0.001
        while not ready():
            if self.aborted():
                raise RoundFormationAborted(f"aborted while its process group formed (waiting for {what})")
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"wait for {what} timed out after {limit:g}s")
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait_until(lambda: self.inner.check(keys), str(keys), timeout)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self.inner.get(key)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self.wait(list(keys))
        return self.inner.multi_get(list(keys))

    def barrier(self, key: str, world_size: int, timeout: timedelta | None = None) -> None:
        """Every one of `world_size` callers of `key` has arrived; the last one to arrive marks it complete."""
        complete = f"{key}/complete"
        if self.inner.add(f"{key}/arrived", 1) == world_size:
            self.inner.set(complete, b"1")
        self._wait_until(lambda: self.inner.check([complete]), f"barrier {key!r} of {world_size}", timeout)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        if block:
            self._wait_until(lambda: self.inner.queue_len(key) > 0, f"queue {key!r}")
        return self.inner.queue_pop(key, False)

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, value)

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        self.inner.multi_set(list(keys), list(values))

    def append(self, key: str, value: str | bytes) -> None:
        self.inner.append(key, value)

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

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()

    def queue_push(self, key: str, value: str | bytes) -> None:
        self.inner.queue_push(key, value)

    def queue_len(self, key: str) -> int:
        return self.inner.queue_len(key)

    def has_extended_api(self) -> bool:
        return self.inner.has_extended_api()

    def clone(self) -> AbortableStore:
        """Another connection to the same store (torch calls it for a thread of its own; torch 2.13's gloo does not)."""
        clone = AbortableStore(self.inner.clone(), self.aborted)
        self.clones.append(clone)
        return clone

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)
        dist.Store.set_timeout(self, timeout)
