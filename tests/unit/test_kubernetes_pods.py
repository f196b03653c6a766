"""What a pod means to discovery (host, slots, listed), the selector and paths sent to the API, and the pod table
kept from a list and its watch events: bookmarks move the resourceVersion on, a 410 asks for a new list."""

from __future__ import annotations

from typing import Any

import pytest

from elastic_control_plane.services.discovery.kubernetes import ApiServer, default_namespace
from elastic_control_plane.services.discovery.pods import (
    Forbidden,
    Gone,
    KubernetesError,
    PodTable,
    check_selector,
    pod_listed,
    pod_name,
    pod_slots,
    pods_path,
)


def pod(
    name: str,
    ready: bool = True,
    gpus: tuple[str, ...] = (),
    annotations: dict[str, str] | None = None,
    deleting: bool = False,
    rv: str = "7",
) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "resourceVersion": rv, "annotations": annotations or {}}
    if deleting:
        metadata["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "metadata": metadata,
        "spec": {
            "containers": [
                {"name": f"c{i}", "resources": {"limits": {"nvidia.com/gpu": g}}} for i, g in enumerate(gpus)
            ]
        },
        "status": {"conditions": [{"type": "Initialized", "status": "True"}, {"type": "Ready", "status": str(ready)}]},
    }


def test_slots_come_from_the_annotation_else_the_gpu_limits_summed_else_the_agent() -> None:
    assert pod_slots(pod("a", annotations={"elastic/slots": "3"}, gpus=("8",))) == 3
    assert pod_slots(pod("a", gpus=("2", "4"))) == 6
    assert pod_slots(pod("a")) is None
    assert pod_slots({"metadata": {"name": "a"}}) is None, "no spec, no annotations"
    assert pod_slots(pod("a", annotations={"elastic/slots": "many"}, gpus=("2",))) == 2, "a bad annotation is absent"
    assert pod_slots(pod("a", annotations={"elastic/slots": "0"})) is None
    assert pod_slots(pod("a", gpus=("0",))) is None


def test_a_pod_is_listed_while_ready_and_not_being_deleted() -> None:
    assert pod_name(pod("worker-0")) == "worker-0"
    assert pod_listed(pod("a"))
    assert not pod_listed(pod("a", ready=False))
    assert not pod_listed(pod("a", deleting=True))
    assert not pod_listed({"metadata": {"name": "a"}, "status": {}}), "no conditions yet"


def test_selectors_are_checked_and_encoded_in_the_path() -> None:
    assert check_selector(" app=elastic , tier!=control ") == "app=elastic,tier!=control"
    for bad in ("", " ", "app=x,", ",app=x"):
        with pytest.raises(ValueError, match="--kubernetes-selector"):
            check_selector(bad)
    path = pods_path("team a", "app=elastic,tier!=control", watch="1", resourceVersion="42")
    assert path == (
        "/api/v1/namespaces/team%20a/pods?labelSelector=app%3Delastic%2Ctier%21%3Dcontrol&watch=1&resourceVersion=42"
    )


def test_a_list_then_events_keep_the_listed_hosts_and_the_resource_version() -> None:
    table = PodTable()
    assert table.replace(
        {"metadata": {"resourceVersion": "10"}, "items": [pod("a", gpus=("2",)), pod("b", ready=False)]}
    )
    assert (table.hosts, table.resource_version) == ({"a": 2}, "10")
    assert table.apply({"type": "MODIFIED", "object": pod("b", rv="11")})
    assert table.hosts == {"a": 2, "b": None}
    assert not table.apply({"type": "MODIFIED", "object": pod("b", rv="12")}), "no change to the hosts"
    assert not table.apply({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "20"}}})
    assert table.resource_version == "20"
    assert table.apply({"type": "MODIFIED", "object": pod("a", gpus=("2",), deleting=True, rv="21")})
    assert table.hosts == {"b": None}
    assert table.apply({"type": "DELETED", "object": pod("b", rv="22")})
    assert not table.apply({"type": "DELETED", "object": pod("c", ready=False, rv="23")}), "never listed"
    assert (table.hosts, table.resource_version) == ({}, "23")
    assert not table.replace({"metadata": {"resourceVersion": "30"}, "items": []})


def test_a_watch_error_of_code_410_asks_for_a_new_list_and_others_are_errors() -> None:
    table = PodTable()
    table.replace({"metadata": {"resourceVersion": "5"}, "items": [pod("a")]})
    with pytest.raises(Gone):
        table.apply({"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}})
    with pytest.raises(KubernetesError, match="500"):
        table.apply({"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "etcd"}})
    with pytest.raises(KubernetesError, match="unknown"):
        table.apply({"type": "SURPRISE", "object": pod("a")})
    assert (table.hosts, table.resource_version) == ({"a": None}, "5"), "unchanged"


def test_forbidden_names_the_verb_the_role_lacks() -> None:
    assert str(Forbidden("watch", "ml")) == (
        "the service account may not watch pods in namespace ml (RBAC: pods get, list, watch)"
    )


def test_the_api_is_the_named_one_else_the_cluster_s_else_a_config_error(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("ELASTIC_KUBERNETES_API", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match="ELASTIC_KUBERNETES_API"):
        ApiServer.from_env(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    (tmp_path / "token").write_text("first\n")
    api = ApiServer.from_env(tmp_path)
    assert (api.url, api.ca_file) == ("https://10.96.0.1:6443", tmp_path / "ca.crt")
    assert api.headers()["Authorization"] == "Bearer first"
    (tmp_path / "token").write_text("rotated\n")
    assert api.headers()["Authorization"] == "Bearer rotated", "read again: bound tokens rotate"
    monkeypatch.setenv("ELASTIC_KUBERNETES_API", "http://127.0.0.1:8001/")
    assert ApiServer.from_env(tmp_path) == ApiServer("http://127.0.0.1:8001")
    assert "Authorization" not in ApiServer.from_env(tmp_path).headers()
    monkeypatch.setenv("ELASTIC_KUBERNETES_API", "127.0.0.1:8001")
    with pytest.raises(ValueError, match="not http"):
        ApiServer.from_env(tmp_path)


def test_the_namespace_is_the_service_account_s_else_default(tmp_path) -> None:
    assert default_namespace(tmp_path) == "default"
    (tmp_path / "namespace").write_text("training\n")
    assert default_namespace(tmp_path) == "training"
