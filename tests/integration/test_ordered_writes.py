"""The active replica's writes are ordered (replication/election.py), against a real 3-member etcd.

Found by the decisions soak (bench/decisions_soak.py): with etcd's leader paused, an attempt of a registry save that
the client had given up on reached etcd after the retry that succeeded and after the next save, and put the job back
one round; the replica that took over restored the older round and the job stalled. Each write is now fenced by the
election key as its previous write left it, so a late duplicate of an older write does nothing; and a write whose
first attempt was applied unanswered still counts as done when its retry finds the key changed by itself."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic_control_plane.replication.election import Leadership, LostRole
from elastic_control_plane.replication.etcd import put_op
from testing.etcd_cluster import EtcdCluster, active_role
from testing.recording_log import RecordingLog

STATE = b"ordered/registry/state"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    members = EtcdCluster(tmp_path_factory.mktemp("etcd-ordered"))
    try:
        members.start()
        yield members
    finally:
        members.stop()


def active(etcd: EtcdCluster, name: str) -> Leadership:
    return active_role(etcd.client(), "ordered", RecordingLog(), name)


def test_a_late_duplicate_of_an_older_write_never_puts_back_an_older_state(etcd: EtcdCluster) -> None:
    role = active(etcd, "a")
    try:
        round_11 = [put_op(STATE, b"round 11")]
        late_attempt = role.fence(), [*round_11, put_op(role.key, b"late", lease=role.lease)]  # as the client sent it
        role.write(round_11)
        role.write([put_op(STATE, b"round 12")])
        replayed = role.client.txn(*late_attempt, [])
        assert not replayed.succeeded, "a duplicate of the older write was applied"
        assert role.client.get(STATE).value == b"round 12"  # type: ignore[union-attr]
    finally:
        role.end("the test ends", revoke=True)
        role.client.close()


def test_a_write_applied_by_an_unanswered_attempt_counts_as_done_and_another_replica_still_fences_this_one(
    etcd: EtcdCluster,
) -> None:
    role = active(etcd, "a")
    try:
        applied = role.client.txn(role.fence(), [put_op(STATE, b"round 13"), put_op(role.key, b"a", lease=role.lease)])
        assert applied.succeeded  # the first attempt, whose answer the client never got
        revision = role.write([put_op(STATE, b"round 13")])  # its retry
        assert revision == applied.revision and role.client.get(STATE).value == b"round 13"  # type: ignore[union-attr]
        role.write([put_op(STATE, b"round 14")])
        role.client.delete(role.key)  # the role went (its lease expired at etcd) and another replica won it
        other = active(etcd, "b")
        try:
            with pytest.raises(LostRole):
                role.write([put_op(STATE, b"from the ex-active")])
            assert role.client.get(STATE).value == b"round 14"  # type: ignore[union-attr]
        finally:
            other.end("the test ends", revoke=True)
            other.client.close()
    finally:
        role.end("the test ends", revoke=True)
        role.client.close()
