"""EventLog: the notifier's incarnation, sequence and history kept in etcd (`--store etcd://...`), so a replica that
takes over goes on with the same incarnation and the next number, and serves `since` from the same history.

Under `<prefix>/notifier/`: `head` ({incarnation, seq}) and `events/<seq>`
(one zlib-compressed msgpack [type, body] per kept event, seq zero-padded so
keys sort in order: a `round` event of thousands of slots is a megabyte of
msgpack, which etcd's JSON gateway takes a tenth of a second to decode,
and a tenth of that compressed). A publish is one fenced txn (`Leadership.write`) made before the
event is sent: the head, the event, and the deletion of the events the
history let go. Subscribers therefore never see a number twice or miss one
across a failover: they catch up from the history as after a restart.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgpack

from elastic_control_plane.replication.election import LostRole
from elastic_control_plane.replication.etcd import EtcdError, delete_op, put_op
from elastic_control_plane.replication.replica import CorruptRecord, Replica, inflate


class EventLogError(RuntimeError):
    """A publish did not reach etcd (out of reach, or the role was lost): it is refused, the publisher resends."""


class EventLog:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._head = replica.key("notifier", "head")
        self._events = replica.key("notifier", "events/")

    def _event_key(self, seq: int) -> bytes:
        return self._events + f"{seq:016d}".encode()

    def load(self) -> tuple[str | None, int, list[tuple[str, dict[str, Any]]]]:
        """The incarnation (None before the first), the latest sequence number and the kept events, oldest first."""
        head = self.replica.client.get(self._head)
        if head is None:
            return None, 0, []
        saved = _unpacked(self._head, head.value)
        if not (isinstance(saved, dict) and isinstance(saved.get("incarnation"), str) and _is_seq(saved.get("seq"))):
            raise CorruptRecord(self._head, "not the notifier's head {incarnation, seq}")
        kvs, _ = self.replica.client.get_prefix(self._events)
        events = []
        for kv in kvs:
            event = _unpacked(kv.key, inflate(kv.key, kv.value))
            if not (
                isinstance(event, list) and len(event) == 2 and isinstance(event[0], str) and isinstance(event[1], dict)
            ):
                raise CorruptRecord(kv.key, "not a kept event [type, body]")
            events.append((event[0], event[1]))
        return saved["incarnation"], int(saved["seq"]), events

    def _write(self, ops: list[dict[str, Any]]) -> None:
        try:
            self.replica.leadership.write(ops)
        except (LostRole, EtcdError) as exc:
            raise EventLogError(f"the event did not reach etcd: {exc}") from None

    def start(self, incarnation: str) -> None:
        """Record a new incarnation (the first replica of a control plane, or after every event was lost)."""
        self._write([put_op(self._head, msgpack.packb({"incarnation": incarnation, "seq": 0}))])

    def append(self, incarnation: str, event: str, body: dict[str, Any], dropped: list[int]) -> None:
        """Keep event number body["seq"] and let go of the numbers `dropped` (the oldest kept, consecutive: one range
        delete however many), in one txn of three operations at most."""
        ops = [
            put_op(self._head, msgpack.packb({"incarnation": incarnation, "seq": body["seq"]})),
            put_op(self._event_key(body["seq"]), zlib.compress(msgpack.packb([event, body]), 1)),
        ]
        if dropped:
            ops.append(delete_op(self._event_key(min(dropped)), until=self._event_key(max(dropped) + 1)))
        self._write(ops)


def _unpacked(key: bytes, data: bytes) -> Any:
    try:
        return msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CorruptRecord(key, f"not msgpack: {exc}") from None


def _is_seq(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
