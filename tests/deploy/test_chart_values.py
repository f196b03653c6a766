"""Values users expect of a chart, as rendered: names (nameOverride, fullnameOverride), discovery under an existing
ServiceAccount, the agents admitted by a Kueue queue, a `helm test` that pings every service as an operator, and two
releases in one namespace that share nothing: no selector, policy, budget or monitor of one takes the other's pods,
and GPU agents ask the device plugin for their GPUs, so two releases never get the same ones."""

from __future__ import annotations

from typing import Any

import yaml

from tests.deploy.conftest import CHART, NAMESPACE, helm, render
from tests.deploy.test_chart_objects import SERVICES, environment, pod_labels, workloads
from tests.deploy.test_chart_security import OWN_FILES, mounted_keys


def test_names_follow_the_overrides() -> None:
    names = {obj["metadata"]["name"] for obj in render(None, "fullnameOverride=train")}
    assert {"train-agent", "train-registry", "train-control-plane"} <= names
    assert all(name.startswith("train-") for name in names)
    renamed = render(None, "nameOverride=trainer")
    assert {pod_labels(w)["app.kubernetes.io/name"] for w in workloads(renamed)} == {"trainer"}


def test_discovery_runs_as_an_existing_service_account_and_nothing_is_made_for_it() -> None:
    objects = render(None, "rbac.serviceAccountName=ops-discovery")
    assert not [obj for obj in objects if obj["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    (discovery,) = [w for w in workloads(objects) if w["metadata"]["name"] == "elastic-discovery"]
    assert discovery["spec"]["template"]["spec"]["serviceAccountName"] == "ops-discovery"


def test_the_agents_pods_carry_the_kueue_queue() -> None:
    objects = render(None, "kueue.queueName=gpu-queue", "agents.pod.labels.team=ml")
    (agents,) = [w for w in workloads(objects) if w["metadata"]["name"] == "elastic-agent"]
    labels = pod_labels(agents)
    assert labels["kueue.x-k8s.io/queue-name"] == "gpu-queue" and labels["team"] == "ml"
    assert all("kueue.x-k8s.io/queue-name" not in pod_labels(w) for w in workloads(objects) if w is not agents)


def test_helm_test_pings_every_service_as_an_operator() -> None:
    (pod,) = [obj for obj in render() if obj["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    (container,) = pod["spec"]["containers"]
    command = container["command"]
    assert command[:3] == ["python", "-m", "elastic_control_plane.bus.ping"]
    env = environment(container)
    assert command[3:] == [
        env[f"ELASTIC_{name.upper()}_ENDPOINT"] for name in ("discovery", "rendezvous", "registry", "notifier")
    ]
    assert mounted_keys({"spec": {"template": {"spec": pod["spec"]}}}) == OWN_FILES["job"]


def release(name: str) -> list[dict[str, Any]]:
    values = CHART / "ci" / "gpu-values.yaml"
    text = helm("template", name, str(CHART), "--namespace", NAMESPACE, "-f", str(values)).stdout
    return [doc for doc in yaml.safe_load_all(text) if doc]


def selectors(obj: dict[str, Any]) -> list[dict[str, str]]:
    """The label selectors (matchLabels) an object picks pods with."""
    spec = obj.get("spec", {})
    if obj["kind"] in ("StatefulSet", "DaemonSet", "PodDisruptionBudget", "PodMonitor"):
        return [spec["selector"]["matchLabels"]]
    if obj["kind"] == "Service":
        return [spec["selector"]]
    if obj["kind"] == "NetworkPolicy":
        return [spec["podSelector"].get("matchLabels", {})]
    return []


def test_two_releases_share_no_pods_and_ask_for_their_own_gpus() -> None:
    first, second = release("team-a"), release("team-b")
    names = lambda objects: {(o["kind"], o["metadata"]["name"]) for o in objects}  # noqa: E731
    assert not names(first) & names(second), "two releases would own the same object"
    for mine, theirs in ((first, second), (second, first)):
        their_pods = [pod_labels(w) for w in workloads(theirs)]
        for obj in mine:
            for selector in selectors(obj):
                assert selector, f"{obj['kind']} {obj['metadata']['name']} selects every pod"
                taken = [labels for labels in their_pods if selector.items() <= labels.items()]
                assert not taken, f"{obj['kind']} {obj['metadata']['name']} takes the other release's pods"
    for objects in (first, second):
        (agents,) = [w for w in workloads(objects) if pod_labels(w)["app.kubernetes.io/component"] == "agent"]
        (container,) = agents["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8, "GPUs come from the device plugin"
    assert set(SERVICES) <= {pod_labels(w)["app.kubernetes.io/component"] for w in workloads(first)}
