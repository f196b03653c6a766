"""The rendezvous' request bodies, checked: a round's hosts and their slots (a count, or the ids of the usable
ones), refused with `bad_request` when they are not what the protocol says."""

from __future__ import annotations

from typing import Any

from elastic_control_plane.bus.service import RequestError
from elastic_control_plane.job.assignments import MAX_SLOTS_PER_HOST


def slots_of(value: Any) -> int | list[int] | None:
    """A host's slots: a count, or the ids of its usable slots (distinct, non-negative), MAX_SLOTS_PER_HOST at most;
    None if neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if 0 <= value <= MAX_SLOTS_PER_HOST else None
    if (
        isinstance(value, list)
        and len(value) <= MAX_SLOTS_PER_HOST
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        and len(set(value)) == len(value)
    ):
        return value
    return None


def parse_hosts(raw: Any) -> list[tuple[str, int | list[int]]]:
    """The hosts of a `new_round` or `restore_round`: [[name, slots], ...], each checked; else `bad_request`."""
    if not isinstance(raw, list):
        raise RequestError("bad_request", "hosts must be a list of [name, slots]")
    hosts: list[tuple[str, int | list[int]]] = []
    for item in raw:
        slots = slots_of(item[1]) if isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) else None
        if slots is None:
            raise RequestError("bad_request", f"bad host entry {item!r}: want [name, slots] or [name, [slot ids]]")
        hosts.append((item[0], slots))
    return hosts
