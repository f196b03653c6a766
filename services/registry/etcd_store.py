"""EtcdJobStore: the registry's durable memory in etcd (`--store etcd://...`), written by the active replica only.

The same contract as the SQLite store (services/registry/store.py, `JobStore`):
a save is one transaction, durable when it returns, of the state document if
it changed and the parts handed over. In etcd, under `<prefix>/registry/`:
`state` (the JSON document, zlib-compressed; one a release before that
wrote as plain JSON still loads) and the parts gathered into `PART_BUCKETS`
buckets, `parts/NN`, each a zlib-compressed JSON map of part key to part
text. The state is written only when it changed. A save rewrites the buckets of the parts it was given, so a save is at
most PART_BUCKETS + 1 operations in one txn whatever the job's size (etcd
refuses a txn of more than 128 operations by default), and a worker's exit
rewrites one bucket. Reports compress about tenfold, so a reset of 4,096 hosts
x 8 stays within the request size etcd accepts.

Every save is fenced by the replica's role (`Leadership.write`): a replica
that lost the role cannot write, and learns it from its first refused save
(`StoreError`, and it steps down).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Mapping
from typing import Any

from elastic_control_plane.replication.election import LostRole
from elastic_control_plane.replication.etcd import EtcdError, put_op
from elastic_control_plane.replication.replica import CorruptRecord, Replica, inflate
from elastic_control_plane.services.registry.store import StoreError

PART_BUCKETS = 64


def bucket_of(part: str) -> int:
    return zlib.crc32(part.encode()) % PART_BUCKETS


class EtcdJobStore:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.where = f"etcd {replica.prefix}/registry"
        self._state_key = replica.key("registry", "state")
        self._buckets: dict[int, dict[str, str]] = {}
        self._saved_state: str | None = None

    def _bucket_key(self, bucket: int) -> bytes:
        return self.replica.key("registry", f"parts/{bucket:02d}")

    def load(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The last saved state and its parts (key: the part, parsed), or None when no job was ever saved."""
        client = self.replica.client
        try:
            state = client.get(self._state_key)
            buckets, _ = client.get_prefix(self.replica.key("registry", "parts/"))
        except EtcdError as exc:
            raise StoreError(f"cannot read the registry's state from {self.where}: {exc}") from None
        parts: dict[str, Any] = {}
        for kv in buckets:
            number = kv.key.decode(errors="replace").rpartition("/")[2]
            if not (number.isdigit() and int(number) < PART_BUCKETS):
                raise CorruptRecord(kv.key, f"not a bucket of the saved parts (00 to {PART_BUCKETS - 1:02d})")
            bucket = _json(kv.key, inflate(kv.key, kv.value))
            if not (isinstance(bucket, dict) and all(isinstance(text, str) for text in bucket.values())):
                raise CorruptRecord(kv.key, "a bucket of the saved parts is not a map of part to text")
            self._buckets[int(number)] = bucket
            parts.update((key, _json(kv.key, text)) for key, text in bucket.items())
        if state is None:
            return None
        plain = state.value.startswith(b"{")  # written before the state was compressed
        self._saved_state = (state.value if plain else inflate(self._state_key, state.value)).decode(errors="replace")
        saved = _json(self._state_key, self._saved_state)
        if not isinstance(saved, dict):
            raise CorruptRecord(self._state_key, "the saved state is not a map")
        return saved, parts

    def last_saved(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """What the last load or save that returned left, from this store's own copy (etcd may be out of reach right
        after a refused save): the state and every part."""
        if self._saved_state is None:
            return None
        parts = {key: json.loads(text) for bucket in self._buckets.values() for key, text in bucket.items()}
        return json.loads(self._saved_state), parts

    def save(self, state: dict[str, Any], parts: Mapping[str, str | None] | None = None) -> bool:
        """Write `state` if it changed and the buckets of `parts` (JSON text, or None to delete), in one fenced txn;
        True when anything was written."""
        text = json.dumps(state, sort_keys=True, separators=(",", ":"))
        parts = parts or {}
        if text == self._saved_state and not parts:
            return False
        touched: dict[int, dict[str, str]] = {}
        for key, value in parts.items():
            number = bucket_of(key)
            bucket = touched.setdefault(number, dict(self._buckets.get(number, {})))
            if value is None:
                bucket.pop(key, None)
            else:
                bucket[key] = value
        ops = [put_op(self._state_key, zlib.compress(text.encode(), 1))] if text != self._saved_state else []
        for number, bucket in touched.items():
            encoded = json.dumps(bucket, sort_keys=True, separators=(",", ":")).encode()
            ops.append(put_op(self._bucket_key(number), zlib.compress(encoded, 1)))
        try:
            self.replica.leadership.write(ops)
        except LostRole as exc:
            raise StoreError(str(exc)) from None
        except EtcdError as exc:
            raise StoreError(f"cannot save to {self.where}: {exc}") from None
        self._buckets.update(touched)
        self._saved_state = text
        return True

    def close(self) -> None:
        """The client belongs to the replica: nothing of the store's own to close."""


def _json(key: bytes, text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CorruptRecord(key, f"not JSON: {exc}") from None
