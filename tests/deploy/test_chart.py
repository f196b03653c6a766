"""The Helm chart checked with a real helm and the Kubernetes API's own schemas: `helm lint --strict` and
`helm template` for each ci/*-values.yaml, every rendered object validated strictly against two Kubernetes versions,
the committed deploy/k8s/ equal to a fresh render, values that make no sense refused with one line, discovery's
rights exactly pods get/list/watch, and the Grafana dashboard over metrics the project exports."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client import REGISTRY

from tests.deploy.conftest import CHART, REPO, assert_ci_values_found, helm, render, render_text

# Two versions the installed kubernetes-validate (>=1.33, pyproject.toml) ships schemas for: an older and a recent one.
KUBERNETES_VERSIONS = ("1.29.0", "1.33.0")
OPERATOR_API = "monitoring.coreos.com/"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "elastic.json"


def test_every_layout_has_a_ci_values_file() -> None:
    assert_ci_values_found()


def test_helm_lint_strict(ci_values: str) -> None:
    result = helm("lint", "--strict", str(CHART), "-f", ci_values, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_object_validates_strictly(ci_values: str, version: str) -> None:
    objects = render(ci_values)
    assert len(objects) >= 10
    for obj in objects:
        if obj["apiVersion"].startswith(OPERATOR_API):  # the Prometheus Operator's CRDs: checked below
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} is not valid for Kubernetes {version}: {exc}")


def test_the_validator_refuses_an_unknown_field() -> None:
    """The strict validation above is a real check: a field the API does not know is refused."""
    service = next(obj for obj in render() if obj["kind"] == "Service")
    service["spec"]["portz"] = service["spec"]["ports"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSIONS[0], strict=True)


def test_the_committed_manifests_equal_a_fresh_render(tmp_path: Path) -> None:
    env = {**os.environ, "ELASTIC_VENV": sys.prefix}  # the helm the fixture installed
    subprocess.run(
        [str(REPO / "deploy" / "render.sh"), str(tmp_path)], env=env, check=True, capture_output=True, timeout=120
    )
    for name in ("elastic.yaml", "replicated.yaml"):
        committed = (REPO / "deploy" / "k8s" / name).read_text()
        assert committed == (tmp_path / name).read_text(), f"deploy/k8s/{name} is stale: run deploy/render.sh"
    kinds = {obj["kind"] for obj in render()}
    assert "Role" in kinds and "Job" not in kinds, "the default values: discovery's Role, no Job"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["agents.slots=0"], "agents.slots must be at least 1, got 0"),
        (["controlPlane.replicas=2"], "controlPlane.replicas 2: the single layout runs one pod per service"),
        (["controlPlane.layout=replicated", "controlPlane.replicas=1"], "the replicated layout needs at least 2"),
        (["agents.slots=4", "agents.gpus=2"], "agents.gpus 2 does not match agents.slots 4"),
        (["agents.slots=4", "agents.resources.limits.nvidia\\.com/gpu=8"], "nvidia.com/gpu 8 does not match"),
        ([], "security.keysSecret is empty: make the keys with `elasticctl keys generate DIR`"),
        (["controlPlane.layout=replicated", "security.keysSecret=k"], "security.etcdTlsSecret is empty"),
    ],
    ids=[
        "slots-0",
        "single-with-2-replicas",
        "replicated-with-1",
        "gpus-not-slots",
        "gpu-limit-not-slots",
        "no-keys",
        "replicated-without-etcd-tls",
    ],
)
def test_values_that_make_no_sense_fail_with_one_line(sets: list[str], message: str) -> None:
    args = ["template", "elastic", str(CHART)]
    for item in sets:
        args += ["--set", item]
    result = helm(*args, check=False)
    assert result.returncode != 0
    # helm adds its own hint ("Use --debug flag to render out invalid YAML") under the error.
    lines = [line for line in result.stderr.splitlines() if line.strip() and not line.startswith("Use --debug")]
    assert len(lines) == 1, result.stderr
    assert message in lines[0]


def test_the_schema_refuses_an_unknown_layout() -> None:
    result = helm("template", "elastic", str(CHART), "--set", "controlPlane.layout=triple", check=False)
    assert result.returncode != 0
    assert "/controlPlane/layout" in result.stderr


def test_the_timing_preset_reaches_every_container_and_an_unknown_one_is_refused() -> None:
    containers = [
        container
        for obj in render(None, "timing=cloud", "job.enabled=true")
        if obj["kind"] in ("StatefulSet", "DaemonSet", "Job")
        for container in obj["spec"]["template"]["spec"]["containers"]
    ]
    assert len(containers) >= 3
    for container in containers:
        assert {"name": "ELASTIC_TIMING", "value": "cloud"} in container["env"], container["name"]
    result = helm("template", "elastic", str(CHART), "--set", "timing=fast", check=False)
    assert result.returncode != 0 and "/timing" in result.stderr


def test_discovery_may_get_list_and_watch_pods_and_nothing_else(ci_values: str) -> None:
    objects = render(ci_values)
    cluster_wide = [obj for obj in objects if obj["kind"] == "ClusterRole"]
    assert all(  # tests/deploy/test_chart_pod_identity.py checks it and its binding
        [(r["apiGroups"], r["resources"], r["verbs"]) for r in role["rules"]]
        == [(["authentication.k8s.io"], ["tokenreviews"], ["create"])]
        for role in cluster_wide
    ), "nothing cluster-wide but reviewing the agents' tokens"
    roles = [obj for obj in objects if obj["kind"] == "Role"]
    workloads = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] in ("StatefulSet", "DaemonSet", "Job")}
    discovery = workloads["elastic-discovery"]["spec"]["template"]["spec"]
    if not roles:  # rbac.create=false: no pod gets a token
        assert "serviceAccountName" not in discovery
    else:
        (role,) = roles
        assert [(r["apiGroups"], r["resources"], sorted(r["verbs"])) for r in role["rules"]] == [
            ([""], ["pods"], ["get", "list", "watch"])
        ]
        (binding,) = [obj for obj in objects if obj["kind"] == "RoleBinding"]
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": role["metadata"]["name"],
        }
        (subject,) = binding["subjects"]
        assert subject["kind"] == "ServiceAccount" and subject["name"] == discovery["serviceAccountName"]
    for name, workload in workloads.items():
        if name != "elastic-discovery":
            spec = workload["spec"]["template"]["spec"]
            assert spec.get("automountServiceAccountToken") is False, f"{name} mounts a service account token"


def exported_metric_series() -> set[str]:
    """Every series name the project's Prometheus metrics export, from the real registry."""
    for package in ("bus", "services", "agent", "libworker", "snapshot", "replication", "elasticctl"):
        for path in sorted((REPO / package).rglob("*.py")):
            if "prometheus_client import" in path.read_text():
                parts = path.relative_to(REPO).with_suffix("").parts
                installed = parts if package == "libworker" else ("elastic_control_plane", *parts)
                importlib.import_module(".".join(installed))
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    return {
        metric.name + suffix
        for metric in REGISTRY.collect()
        if metric.name.startswith("elastic_")
        for suffix in suffixes.get(metric.type, ("",))
    }


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_metric_series()
    assert "elastic_registry_resets_total" in exported and "elastic_commit_seconds_bucket" in exported
    queried: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = set(re.findall(r"\belastic_[a-z_]+", target["expr"]))
            assert names, f"panel {panel['title']!r} queries no metric of ours: {target['expr']}"
            assert names <= exported, f"panel {panel['title']!r} queries {sorted(names - exported)}, not exported"
            queried |= names
    for wanted in ("elastic_registry_workers", "elastic_registry_resets_total", "elastic_agent_workers"):
        assert wanted in queried, f"the dashboard does not show {wanted}"


def test_the_dashboard_is_provisioned_as_a_configmap_for_grafanas_sidecar() -> None:
    assert "kind: ConfigMap" not in render_text(), "off by default"
    (config_map,) = [obj for obj in render(None, "grafana.dashboard=true") if obj["kind"] == "ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["elastic.json"]) == json.loads(DASHBOARD.read_text())


def test_the_prometheus_operators_objects_scrape_every_pod_and_carry_the_checked_alerts(tmp_path: Path) -> None:
    """Asked for (gpu-values.yaml): a PodMonitor whose selector takes every pod of the release and scrapes the port
    named `metrics` each serving pod has, and a PrometheusRule whose groups are deploy/prometheus/alerts.yml's,
    which promtool checks as rules; not asked for (the defaults), neither is rendered."""
    objects = render(str(CHART / "ci" / "gpu-values.yaml"))
    (monitor,) = [obj for obj in objects if obj["kind"] == "PodMonitor"]
    assert monitor["apiVersion"] == OPERATOR_API + "v1" and monitor["metadata"]["labels"]["release"]
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    for workload in (obj for obj in objects if obj["kind"] in ("StatefulSet", "DaemonSet")):
        template = workload["spec"]["template"]
        assert selector.items() <= template["metadata"]["labels"].items(), workload["metadata"]["name"]
        ports = {port["name"] for c in template["spec"]["containers"] for port in c.get("ports", [])}
        assert "metrics" in ports, workload["metadata"]["name"]
    (rule,) = [obj for obj in objects if obj["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())
    assert (CHART / "alerts" / "alerts.yml").read_text() == ALERTS.read_text(), "the chart's copy is stale"
    rendered = tmp_path / "rules.yml"
    rendered.write_text(yaml.safe_dump(rule["spec"]))
    checked = subprocess.run(["promtool", "check", "rules", str(rendered)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0 and "SUCCESS: 6 rules found" in checked.stdout, checked.stdout + checked.stderr
    assert not [obj for obj in render() if obj["apiVersion"].startswith(OPERATOR_API)]
