"""The etcd store's `last_saved` (issue 45, write then apply): after a refused save, what the registry goes back to is
what the last save that returned left, read from the store's own copy, since etcd may be out of reach right then."""

from __future__ import annotations

import json
from typing import Any

import pytest

from elastic_control_plane.replication.etcd import EtcdError
from elastic_control_plane.services.registry.etcd_store import EtcdJobStore
from elastic_control_plane.services.registry.store import StoreError


class RefusableRole:
    """The active replica's fenced write: kept while `refusing` is False, refused as etcd refuses otherwise."""

    def __init__(self) -> None:
        self.refusing = False
        self.writes: list[list[Any]] = []

    def write(self, ops: list[Any]) -> None:
        if self.refusing:
            raise EtcdError("etcd refused: the leader changed")
        self.writes.append(ops)


class Replica:
    prefix = "job"

    def __init__(self) -> None:
        self.leadership = RefusableRole()

    def key(self, service: str, name: str) -> bytes:
        return f"{self.prefix}/{service}/{name}".encode()


def test_a_refused_save_leaves_last_saved_as_the_save_before_it() -> None:
    replica = Replica()
    store = EtcdJobStore(replica)  # type: ignore[arg-type]
    assert store.last_saved() is None
    first = {"last_job_id": 1, "job": {"state": "waiting"}}
    store.save(first, {"reports/host-1": json.dumps({"rows": [1]}), "reports/host-2": json.dumps({"rows": [2]})})
    replica.leadership.refusing = True
    with pytest.raises(StoreError):
        store.save({"last_job_id": 2, "job": {"state": "running"}}, {"reports/host-1": None})
    assert store.last_saved() == (first, {"reports/host-1": {"rows": [1]}, "reports/host-2": {"rows": [2]}})
    replica.leadership.refusing = False
    assert store.save({"last_job_id": 2, "job": {"state": "running"}}, {"reports/host-1": None})
    assert store.last_saved() == ({"last_job_id": 2, "job": {"state": "running"}}, {"reports/host-2": {"rows": [2]}})
