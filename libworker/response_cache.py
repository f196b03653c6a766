"""The negotiation's response cache: every operation agreed before keeps a position, the same on every rank.

As in Horovod's response cache, a name agreed once (with its signature) gets
the next free position; every rank takes the same decisions in the same
order (libworker.negotiation), so every rank's cache holds the same names at
the same positions, and a cycle sends one flag per position instead of the
signatures. The cache holds at most CACHE_CAPACITY names and is cleared whole
when full (the same cycle everywhere); it lives for one round.
"""

from __future__ import annotations

import os

from libworker.signatures import Signature

CACHE_CAPACITY = 1024


def cache_enabled() -> bool:
    """ELASTIC_NEGOTIATION_CACHE=0 makes every cycle take the full path (for measuring what the cache saves)."""
    return os.environ.get("ELASTIC_NEGOTIATION_CACHE", "1") != "0"


class ResponseCache:
    """Agreed names, each with its position and the signature it was last agreed with."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[int, Signature]] = {}
        self._names: list[str] = []

    def __len__(self) -> int:
        return len(self._names)

    def position_of(self, name: str, signature: Signature) -> int | None:
        """The position of `name` if it was agreed with this very signature, else None."""
        hit = self._entries.get(name)
        if hit is None or (hit[1] is not signature and hit[1] != signature):
            return None
        return hit[0]

    def at(self, position: int) -> tuple[str, Signature]:
        """The name at `position` and its signature."""
        name = self._names[position]
        return name, self._entries[name][1]

    def signature_of(self, name: str) -> Signature:
        return self._entries[name][1]

    def remember(self, name: str, signature: Signature) -> None:
        """Cache `name`'s agreed signature; every rank takes the same decisions, so every cache stays the same."""
        if name in self._entries:
            self._entries[name] = (self._entries[name][0], signature)
            return
        if len(self._names) >= CACHE_CAPACITY:
            self._entries.clear()
            self._names.clear()
        self._entries[name] = (len(self._names), signature)
        self._names.append(name)
