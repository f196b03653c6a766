"""HostLists: the host list a discovery source's thread keeps (Kubernetes pods: kubernetes.py; a Slurm job's nodes:
slurm.py) and hands to the discovery loop: `hosts()` is None until the source first answered; each new list is
replaced whole and wakes the loop through `fileno()`, a pipe that `take()` empties. `excluded`: the hosts the source
says the job runs without, each {host, requeue, reason} (a requeued Slurm job's; none from Kubernetes); `take_lost()`:
the hosts it found gone since the last take (a Slurm node set DOWN), which discovery takes as lost at once, without
waiting for their heartbeats to stop (each once: an agent that registers again is not lost again for it)."""

from __future__ import annotations

import os
import threading
from typing import Any


class HostLists:
    def __init__(self) -> None:
        self._hosts: dict[str, int | None] | None = None
        self.excluded: list[dict[str, Any]] = []
        self._lost: set[str] = set()
        self._lost_lock = threading.Lock()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)

    def hosts(self) -> dict[str, int | None] | None:
        return self._hosts

    def fileno(self) -> int:
        """A descriptor readable after a change; `take()` empties it."""
        return self._wake_read

    def take(self) -> dict[str, int | None] | None:
        """`hosts()`, the wake-ups that told of it taken from `fileno()`."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        return self._hosts

    def put(self, hosts: dict[str, int | None]) -> None:
        """Take `hosts` as the list, and wake the loop (the thread's side; not once `close()` began)."""
        self._hosts = hosts
        try:
            os.write(self._wake_write, b"\0")
        except (BlockingIOError, OSError):
            pass  # a full pipe wakes the loop already; a closed one: stopping

    def found_lost(self, hosts: set[str]) -> None:
        """The thread's side: `hosts` are gone (the loop is woken by the `put` that follows)."""
        with self._lost_lock:
            self._lost |= hosts

    def take_lost(self) -> set[str]:
        """The hosts found gone since the last take."""
        with self._lost_lock:
            taken, self._lost = self._lost, set()
        return taken

    def close(self) -> None:
        os.close(self._wake_read)
        os.close(self._wake_write)
