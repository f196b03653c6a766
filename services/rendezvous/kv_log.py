"""KvLog: the rendezvous's key-value store kept in etcd (`--store etcd://...`), so a round's keys (the address of its
TCPStore) survive a failover to another replica.

Under `<prefix>/rendezvous/kv/`, one etcd key per store key. Every write is
fenced by the replica's role (`Leadership.write`) and made before the store
answers, so a value a worker was given is in etcd; a replica that takes over
loads them all. Without etcd the rendezvous keeps its store in memory only.
"""

from __future__ import annotations

from elastic_control_plane.replication.election import MAX_WRITE_OPS, LostRole
from elastic_control_plane.replication.etcd import EtcdError, delete_op, put_op
from elastic_control_plane.replication.replica import CorruptRecord, Replica


class KvLogError(RuntimeError):
    """A write did not reach etcd (out of reach, or the role was lost): the request that caused it is refused."""


class KvLog:
    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self._prefix = replica.key("rendezvous", "kv/")

    def load(self) -> dict[str, bytes]:
        kvs, _ = self.replica.client.get_prefix(self._prefix)
        store = {}
        for kv in kvs:
            try:
                store[kv.key[len(self._prefix) :].decode()] = kv.value
            except UnicodeDecodeError:
                raise CorruptRecord(kv.key, "not a UTF-8 key of the rendezvous's store") from None
        return store

    def _write(self, ops: list[dict]) -> None:
        try:
            self.replica.leadership.write(ops)
        except (LostRole, EtcdError) as exc:
            raise KvLogError(f"the store's write did not reach etcd: {exc}") from None

    def set(self, key: str, value: bytes) -> None:
        self._write([put_op(self._prefix + key.encode(), value)])

    def drop_prefixes(self, prefixes: list[str]) -> None:
        """Delete every key under each of `prefixes` (the rounds that are over): one range delete each, in txns of
        at most MAX_WRITE_OPS operations."""
        ops = [delete_op(self._prefix + prefix.encode(), prefix=True) for prefix in prefixes]
        for start in range(0, len(ops), MAX_WRITE_OPS):
            self._write(ops[start : start + MAX_WRITE_OPS])

    def clear(self) -> None:
        self._write([delete_op(self._prefix, prefix=True)])
