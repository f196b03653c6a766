"""The chart's upgrades and disruptions, as rendered: a chart release changes no pod template (no version labels in
them), agents are replaced only when their pod is deleted (OnDelete) and a voluntary disruption takes one at a time
(a PodDisruptionBudget), each documented `helm upgrade` changes no field the API refuses to change, GPU agents are
Guaranteed, snapshots have a memory volume apart from /dev/shm, and a values file can give every pod what GPU clusters
need (volumes, env, scheduling, runtime class, sidecars)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.conftest import CHART, NAMESPACE, REPO, helm, render
from tests.deploy.test_chart_objects import component, workloads

CI = REPO / "deploy/helm/elastic/ci"
# What the API server refuses to change in place, per kind (a `helm upgrade` touching one fails).
IMMUTABLE = {
    "StatefulSet": (
        ("spec", "selector"),
        ("spec", "serviceName"),
        ("spec", "volumeClaimTemplates"),
        ("spec", "podManagementPolicy"),
    ),
    "DaemonSet": (("spec", "selector"),),
    "Job": (("spec", "template"), ("spec", "selector")),
    "Service": (("spec", "clusterIP"),),
}


def by_name(objects: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def dig(obj: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key, {}) if isinstance(obj, dict) else {}
    return obj


def immutable_changes(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> list[str]:
    """Fields of objects in both renders that the API would refuse to change."""
    old, new = by_name(before), by_name(after)
    changes = []
    for key in old.keys() & new.keys():
        for path in IMMUTABLE.get(key[0], ()):
            if dig(old[key], path) != dig(new[key], path):
                changes.append(f"{key[0]} {key[1]}: {'.'.join(path)}")
    return changes


def render_bumped_chart(tmp_path: Path, values: str) -> list[dict[str, Any]]:
    """The chart as its next release would be (Chart.yaml's version and appVersion bumped), rendered."""
    chart = tmp_path / "elastic"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta["version"], meta["appVersion"] = "9.9.9", "9.9.9"
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    text = helm("template", "elastic", str(chart), "--namespace", NAMESPACE, "-f", values).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def test_a_new_chart_release_changes_no_pod_template(tmp_path: Path) -> None:
    for values in (CI / "cpu-values.yaml", CI / "replicated-values.yaml"):
        before, after = render(str(values)), render_bumped_chart(tmp_path / values.stem, str(values))
        templates = lambda objects: {w["metadata"]["name"]: w["spec"]["template"] for w in workloads(objects)}  # noqa: E731
        assert templates(before) == templates(after), "a pod template carries the chart's version"
        assert immutable_changes(before, after) == []
        labels = by_name(after)[("StatefulSet", "elastic-agent")]["metadata"]["labels"]
        assert labels["helm.sh/chart"] == "elastic-9.9.9", "the objects themselves still say their release"


def test_each_documented_upgrade_changes_no_immutable_field() -> None:
    for values in (CI / "cpu-values.yaml", CI / "replicated-values.yaml", CI / "daemonset-values.yaml"):
        before = render(str(values))
        for change in (
            "image.tag=0.2.0",
            "agents.replicas=6",
            "timing=cloud",
            "controlPlane.resources.limits.memory=4Gi",
        ):
            assert immutable_changes(before, render(str(values), change)) == [], (values.name, change)


def test_an_upgrade_the_api_would_refuse_is_caught_and_documented_as_such() -> None:
    """The check above is a real one: resizing etcd's volumes, or switching layouts, changes a StatefulSet's
    volumeClaimTemplates, which the API refuses to change (docs/kubernetes.md says how to do either instead)."""
    before = render(str(CI / "replicated-values.yaml"))
    assert immutable_changes(
        before, render(str(CI / "replicated-values.yaml"), "controlPlane.etcd.storage.size=8Gi")
    ) == ["StatefulSet elastic-etcd: spec.volumeClaimTemplates"]
    switched = render(str(CI / "replicated-values.yaml"), "controlPlane.layout=single", "controlPlane.replicas=null")
    assert "StatefulSet elastic-registry: spec.volumeClaimTemplates" in immutable_changes(before, switched)


def test_agents_are_replaced_only_when_their_pod_is_deleted_and_drained_one_at_a_time() -> None:
    for values in ("cpu-values.yaml", "daemonset-values.yaml"):
        objects = render(str(CI / values))
        (agents,) = [w for w in workloads(objects) if component(w) == "agent"]
        assert agents["spec"]["updateStrategy"] == {"type": "OnDelete"}
        budgets = [
            o for o in objects if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] == "elastic-agent"
        ]
        assert [b["spec"]["maxUnavailable"] for b in budgets] == [1]
        assert (
            budgets[0]["spec"]["selector"]["matchLabels"].items()
            <= agents["spec"]["template"]["metadata"]["labels"].items()
        )


def test_gpu_agents_are_guaranteed_and_snapshots_have_their_own_memory_volume() -> None:
    objects = render(str(CI / "gpu-values.yaml"))
    (agents,) = [w for w in workloads(objects) if component(w) == "agent"]
    pod = agents["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    requests, limits = container["resources"]["requests"], container["resources"]["limits"]
    assert {k: requests[k] for k in ("cpu", "memory")} == {k: limits[k] for k in ("cpu", "memory")}, "Guaranteed"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert volumes[mounts["/snapshots"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert volumes[mounts["/dev/shm"]]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "ELASTIC_SHM_DIR", "value": "/snapshots"} in container["env"]


def test_a_values_file_gives_every_pod_what_a_gpu_cluster_needs(tmp_path: Path) -> None:
    pod = {
        "labels": {"team": "ml"},
        "annotations": {"example.com/owner": "ml"},
        "priorityClassName": "training",
        "runtimeClassName": "nvidia",
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"team": "ml"}},
            }
        ],
        "volumes": [{"name": "ckpt", "persistentVolumeClaim": {"claimName": "checkpoints"}}],
        "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
        "env": [{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}],
        "envFrom": [{"configMapRef": {"name": "nccl"}}],
        "initContainers": [{"name": "wait", "image": "busybox", "command": ["true"]}],
        "extraContainers": [{"name": "sidecar", "image": "busybox", "command": ["sleep", "inf"]}],
        "resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": "eight-gpus"}],
    }
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "security": {"keysSecret": "k"},
                "job": {"enabled": True, "pod": pod},
                "agents": {"pod": pod},
                "controlPlane": {"pod": pod},
            }
        )
    )
    objects = render(str(values))
    for workload in workloads(objects):
        spec, meta = workload["spec"]["template"]["spec"], workload["spec"]["template"]["metadata"]
        name = workload["metadata"]["name"]
        assert meta["labels"]["team"] == "ml" and meta["annotations"] == pod["annotations"], name
        assert spec["priorityClassName"] == "training" and spec["runtimeClassName"] == "nvidia", name
        assert spec["topologySpreadConstraints"] == pod["topologySpreadConstraints"], name
        assert [c["name"] for c in spec["initContainers"]] == ["wait"], name
        main, sidecar = spec["containers"]
        assert sidecar["name"] == "sidecar", name
        assert {"name": "ckpt", "mountPath": "/ckpt"} in main["volumeMounts"], name
        assert pod["volumes"][0] in spec["volumes"], name
        assert pod["env"][0] in main["env"] and main["envFrom"] == pod["envFrom"], name
        assert spec["resourceClaims"] == pod["resourceClaims"], name
    (agents,) = [
        w for w in workloads(render(str(values), "agents.resources.claims[0].name=gpus")) if component(w) == "agent"
    ]
    assert agents["spec"]["template"]["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpus"}]
