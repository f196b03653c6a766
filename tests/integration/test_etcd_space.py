"""etcd for weeks (issue 45): a real 3-member etcd whose backend quota is small. When etcd refuses writes for space
(its NOSPACE alarm raised), the active replica's next write compacts, defragments each member and disarms the alarm,
says so, and goes through; a replica writing thousands of revisions compacts etcd's history itself; and the
registry's state is saved compressed."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from elastic_control_plane.replication import election
from elastic_control_plane.replication.election import Leadership
from elastic_control_plane.replication.etcd import EtcdClient, EtcdRefused, put_op, space_exceeded
from elastic_control_plane.replication.replica import Replica
from elastic_control_plane.replication.store_metrics import EtcdSizeCollector
from elastic_control_plane.services.registry.etcd_store import EtcdJobStore
from testing.etcd_cluster import EtcdCluster, active_role
from testing.recording_log import RecordingLog

QUOTA = 32 * 1024 * 1024


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdCluster]:
    members = EtcdCluster(tmp_path / "etcd", quota_bytes=QUOTA)
    try:
        members.start()
        yield members
    finally:
        members.stop()


def active(client: EtcdClient, said: RecordingLog) -> Leadership:
    return active_role(client, "space", said)


def fill_until_refused(client: EtcdClient) -> EtcdRefused:
    """Overwrite one key with a MiB at a time until etcd refuses for space (every version kept: no compaction)."""
    for number in range(4 * QUOTA // 2**20):
        try:
            client.put(b"space/junk", bytes([number % 256]) * 2**20)
        except EtcdRefused as exc:
            assert space_exceeded(exc), exc
            return exc
    raise AssertionError("etcd took four times its quota")


def scraped_sizes(client: EtcdClient) -> dict[str, dict[str, float]]:
    """What Prometheus would scrape of etcd's size from a replicated service: {metric: {member: bytes}}."""
    registry = CollectorRegistry()
    registry.register(EtcdSizeCollector(client))
    sizes: dict[str, dict[str, float]] = {}
    for family in registry.collect():
        for sample in family.samples:
            sizes.setdefault(sample.name, {})[sample.labels["member"]] = sample.value
    return sizes


def test_a_write_refused_for_space_reclaims_it_and_goes_through(etcd: EtcdCluster) -> None:
    client, said = EtcdClient(etcd.client_endpoints, deadline=30.0), RecordingLog()
    try:
        role = active(client, said)
        fill_until_refused(client)
        full = scraped_sizes(client)
        assert set(full["elastic_etcd_db_bytes"]) == set(etcd.client_endpoints)
        assert max(full["elastic_etcd_db_bytes"].values()) >= QUOTA * 0.9, "the metric shows a database at its quota"
        role.write([put_op(b"space/registry/state", b"the job")])
        assert client.get(b"space/registry/state").value == b"the job"  # type: ignore[union-attr]
        events = dict(said.events)
        assert "etcd_space_exceeded" in events
        before, after = (
            events["etcd_space_reclaimed"]["backend_bytes_before"],
            events["etcd_space_reclaimed"]["backend_bytes_after"],
        )
        assert after < before, "defragmented"
        reclaimed = scraped_sizes(client)["elastic_etcd_db_bytes"]
        assert max(reclaimed.values()) < QUOTA / 2, "the metric shows the space given back"
        client.put(b"space/junk", b"small")  # the alarm is disarmed: any write goes
        role.end("the test ends", revoke=True)
    finally:
        client.close()


def test_a_replica_writing_many_revisions_compacts_etcds_history(
    etcd: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(election, "COMPACT_EVERY", 200)
    monkeypatch.setattr(election, "KEEP_REVISIONS", 50)
    client, said = EtcdClient(etcd.client_endpoints), RecordingLog()
    try:
        role = active(client, said)
        revisions = [role.write([put_op(b"space/registry/state", str(n).encode())]) for n in range(300)]
        with pytest.raises(EtcdRefused) as compacted:
            client.get_at(b"space/registry/state")  # the current revision reads fine
            next(iter(client.watch(b"space/registry/state", start_revision=revisions[0], stop=threading.Event())))
        assert compacted.value.code == 11, "the oldest revisions are gone"
        role.end("the test ends", revoke=True)
    finally:
        client.close()


def test_the_registrys_state_is_saved_compressed_and_an_older_plain_one_still_loads(etcd: EtcdCluster) -> None:
    client, said = EtcdClient(etcd.client_endpoints), RecordingLog()
    try:
        replica = Replica(client, "space", active(client, said))
        state = {"last_job_id": 1, "job": {"spec": {"command": ["python", "train.py"] * 200}, "state": "running"}}
        EtcdJobStore(replica).save(state, {"reports/host-1": json.dumps({"rows": [1]})})
        stored = client.get(b"space/registry/state").value  # type: ignore[union-attr]
        assert len(stored) < len(json.dumps(state)) / 4, "compressed"
        assert EtcdJobStore(replica).load() == (state, {"reports/host-1": {"rows": [1]}})
        replica.leadership.write([put_op(b"space/registry/state", json.dumps(state).encode())])
        assert EtcdJobStore(replica).load() == (state, {"reports/host-1": {"rows": [1]}}), (
            "as an older release saved it"
        )
        replica.leadership.end("the test ends", revoke=True)
    finally:
        client.close()


def test_a_standby_reclaims_a_full_etcd_itself_when_no_replica_is_active_to_do_it(etcd: EtcdCluster) -> None:
    """Found by the decisions soak: with etcd full, every replica that stepped down failed to register again (a lease
    grant is refused for space too), so none became active to reclaim the space and the control plane stayed down."""
    client, said = EtcdClient(etcd.client_endpoints, deadline=30.0), RecordingLog()
    try:
        fill_until_refused(client)
        role = active(client, said)  # registers and campaigns on the full etcd
        assert "etcd_space_reclaimed" in dict(said.events)
        role.write([put_op(b"space/registry/state", b"the job")])
        role.end("the test ends", revoke=True)
    finally:
        client.close()
