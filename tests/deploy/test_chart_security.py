"""The chart's doors, as rendered: it refuses to render without keys unless told `insecure: true`; each pod holds only
its role's keys (agents and the job no server secret, no other role's keypair, no etcd certificate); etcd speaks TLS
with client certificates required; and its NetworkPolicies, evaluated here with the API's semantics over the rendered
pods' labels and ports, admit exactly the paths the control plane uses and refuse the rest: another namespace, another
release, an agent or the job calling etcd, anyone calling the job's pod."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import CHART, NAMESPACE, REPO, helm, render
from tests.deploy.test_chart_objects import (
    SERVICES,
    component,
    containers,
    environment,
    etcd_flags,
    pod_labels,
    workloads,
)

CI = REPO / "deploy/helm/elastic/ci"
SERVER_PUBLIC = {"server.key"}
OWN_FILES = {
    "agent": SERVER_PUBLIC | {"agent.key", "agent.key_secret"},
    "job": SERVER_PUBLIC | {"client.key", "client.key_secret"},
    "service": SERVER_PUBLIC
    | {"server.key_secret", "service.key", "service.key_secret", "client.key", "client.key_secret"}
    | {f"authorized/{name}.key" for name in ("service", "agent", "client")},
}
ETCD_CLIENT = {"etcd/ca.crt", "etcd/client.crt", "etcd/client.key"}


def mounted_keys(workload: dict[str, Any]) -> set[str]:
    """The paths under /keys a pod of `workload` gets from its projected keys volume."""
    (volume,) = [v for v in workload["spec"]["template"]["spec"].get("volumes", []) if v["name"] == "keys"]
    return {item["path"] for source in volume["projected"]["sources"] for item in source["secret"]["items"]}


@pytest.mark.parametrize("values", ["cpu-values.yaml", "daemonset-values.yaml"])
def test_each_pod_holds_only_its_roles_keys(values: str) -> None:
    objects = render(str(CI / values))
    replicated = values == "daemonset-values.yaml"
    seen = set()
    for workload, container in containers(objects):
        kind = component(workload)
        if kind == "etcd":
            continue
        role = "service" if kind in SERVICES else kind
        expected = OWN_FILES[role] | (ETCD_CLIENT if replicated and role == "service" else set())
        assert mounted_keys(workload) == expected, kind
        assert {"name": "keys", "mountPath": "/keys", "readOnly": True} in container["volumeMounts"]
        assert environment(container)["ELASTIC_KEYS"] == "/keys" and "ELASTIC_INSECURE" not in environment(container)
        seen.add(role)
    assert seen == ({"service", "agent"} if replicated else {"service", "agent", "job"})


def test_etcd_speaks_tls_to_clients_and_peers_and_requires_certificates() -> None:
    objects = render(str(CI / "daemonset-values.yaml"))
    (etcd,) = [w for w in workloads(objects) if component(w) == "etcd"]
    pod = etcd["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["etcd", "--config-file=/config/etcd.json"]
    flags = dict(arg.partition("=")[::2] for arg in etcd_flags(etcd))
    for name in (
        "--listen-client-urls",
        "--advertise-client-urls",
        "--listen-peer-urls",
        "--initial-advertise-peer-urls",
    ):
        assert flags[name].startswith("https://"), name
    assert all(peer.partition("=")[2].startswith("https://") for peer in flags["--initial-cluster"].split(","))
    assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags
    assert flags["--trusted-ca-file"] == flags["--peer-trusted-ca-file"] == "/tls/ca.crt"
    (tls,) = [v for v in pod["volumes"] if v["name"] == "tls"]
    assert tls["secret"]["secretName"] == "elastic-etcd-tls"
    assert {item["key"] for item in tls["secret"]["items"]} == {"ca.crt", "server.crt", "server.key"}, "no CA key"
    assert flags["--listen-metrics-urls"] == "http://0.0.0.0:2381"
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_insecure_is_said_in_every_container_and_mounts_no_keys() -> None:
    objects = render(str(CI / "single-host-values.yaml"))
    for workload, container in containers(objects):
        assert environment(container)["ELASTIC_INSECURE"] == "1" and "ELASTIC_KEYS" not in environment(container)
        assert all(v["name"] != "keys" for v in workload["spec"]["template"]["spec"].get("volumes", []))
    install = helm("install", "elastic", str(CHART), "--dry-run=client", "-f", str(CI / "single-host-values.yaml"))
    assert "WARNING: security.insecure is true" in install.stdout, install.stdout


@dataclass(frozen=True)
class Pod:
    """A pod that sends: its namespace and labels."""

    namespace: str
    labels: dict[str, str] = field(default_factory=dict)


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector over `labels`, as the API server evaluates it."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        held = key in labels
        ok = {
            "In": held and labels.get(key) in values,
            "NotIn": not held or labels[key] not in values,
            "Exists": held,
            "DoesNotExist": not held,
        }[operator]
        if not ok:
            return False
    return True


def peer_admits(peer: dict[str, Any], policy_namespace: str, source: Pod) -> bool:
    namespace_labels = {"kubernetes.io/metadata.name": source.namespace}
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector", {}), source.labels)


def admits(objects: list[dict[str, Any]], source: Pod, target: dict[str, str], port: int) -> bool:
    """Does the API's NetworkPolicy semantics let `source` reach a pod of this release labelled `target` on `port`?
    A pod no policy selects takes anything; a selected one only what some rule of a selecting policy admits."""
    policies = [
        obj
        for obj in objects
        if obj["kind"] == "NetworkPolicy"
        and "Ingress" in obj["spec"]["policyTypes"]
        and selects(obj["spec"]["podSelector"], target)
    ]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(p["port"] == port for p in ports):
                continue
            peers = rule.get("from")
            if not peers or any(peer_admits(peer, NAMESPACE, source) for peer in peers):
                return True
    return False


def release_pods(objects: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {component(w): pod_labels(w) for w in workloads(objects)}


def test_the_network_policies_admit_the_control_planes_paths_and_nothing_else() -> None:
    objects = render(str(CI / "replicated-values.yaml"))
    pods = release_pods(objects)
    pod = {name: Pod(NAMESPACE, labels) for name, labels in pods.items()}
    elsewhere = Pod("other", pods["agent"])  # the same labels, another namespace
    other_release = Pod(NAMESPACE, {**pods["agent"], "app.kubernetes.io/instance": "other"})
    operator, monitoring = Pod("ops"), Pod("monitoring")
    allowed = [
        (pod["agent"], "registry", 5552),
        (pod["agent"], "notifier", 5554),
        (pod["job"], "registry", 5552),
        (pod["registry"], "notifier", 5553),
        (operator, "registry", 5552),
        (pod["registry"], "etcd", 2379),
        (pod["discovery"], "etcd", 2379),
        (pod["etcd"], "etcd", 2380),
        (pod["etcd"], "etcd", 2379),
        (monitoring, "registry", 9552),
        (monitoring, "etcd", 2381),
        (monitoring, "agent", 9555),
        (pod["agent"], "agent", 29500),
        (pod["registry"], "agent", 41000),
    ]
    refused = [
        (elsewhere, "registry", 5552),
        (other_release, "registry", 5552),
        (Pod("ops"), "etcd", 2379),
        (pod["agent"], "etcd", 2379),
        (pod["job"], "etcd", 2379),
        (pod["registry"], "etcd", 2380),
        (pod["agent"], "registry", 9999),
        (pod["job"], "agent", 29500),
        (elsewhere, "agent", 29500),
        (pod["agent"], "job", 8080),
        (pod["registry"], "job", 8080),
    ]
    for source, target, port in allowed:
        assert admits(objects, source, pods[target], port), f"{source} -> {target}:{port} should be admitted"
    for source, target, port in refused:
        assert not admits(objects, source, pods[target], port), f"{source} -> {target}:{port} should be refused"


def test_metrics_are_admitted_from_the_configured_namespace_only() -> None:
    objects = render(str(CI / "gpu-values.yaml"))
    pods = release_pods(objects)
    assert admits(objects, Pod("monitoring"), pods["agent"], 9555)
    assert admits(objects, Pod("monitoring"), pods["registry"], 9552)
    assert not admits(objects, Pod("default"), pods["agent"], 9555)
    assert not admits(objects, Pod("default"), pods["registry"], 9552)


def test_the_policies_can_be_turned_off() -> None:
    objects = render(str(CI / "single-host-values.yaml"))
    assert not [obj for obj in objects if obj["kind"] == "NetworkPolicy"]
    assert admits(objects, Pod("other"), release_pods(objects)["registry"], 5552)


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim"}
RESTRICTED_VOLUMES |= {"projected", "secret"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """What the `restricted` Pod Security Standard (Kubernetes 1.25+) refuses in a pod spec, one line each."""
    found = []
    pod_security = pod.get("securityContext", {})
    for name in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(name):
            found.append(f"{name} is set")
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {volume['name']} is of type {sorted(kinds)}")
    for container in pod.get("initContainers", []) + pod["containers"]:
        security, name = container.get("securityContext", {}), container["name"]

        def setting(key: str, security: dict[str, Any] = security) -> Any:
            return security.get(key, pod_security.get(key))

        if security.get("privileged"):
            found.append(f"{name} is privileged")
        if security.get("allowPrivilegeEscalation") is not False:
            found.append(f"{name} does not set allowPrivilegeEscalation: false")
        if setting("runAsNonRoot") is not True or setting("runAsUser") == 0:
            found.append(f"{name} may run as root")
        if (setting("seccompProfile") or {}).get("type") not in ("RuntimeDefault", "Localhost"):
            found.append(f"{name} has no RuntimeDefault or Localhost seccomp profile")
        capabilities = security.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            found.append(f"{name} does not drop ALL capabilities")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{name} adds capabilities {sorted(capabilities['add'])}")
        if any("hostPort" in port for port in container.get("ports", [])):
            found.append(f"{name} uses a hostPort")
    return found


def pod_specs(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(w["metadata"]["name"], w["spec"]["template"]["spec"]) for w in workloads(objects)]


def test_every_rendered_pod_passes_the_restricted_pod_security_standard(ci_values: str) -> None:
    """Every pod of every values file, but for the capabilities a values file gives agents back (EFA's IPC_LOCK)."""
    asked = (yaml.safe_load(open(ci_values)).get("agents") or {}).get("capabilities") or []
    allowed = [f"agent adds capabilities {sorted(asked)}"] if asked else []
    for name, pod in pod_specs(render(ci_values)):
        found = restricted_violations(pod)
        assert found == (allowed if name == "elastic-agent" else []), name


def test_the_restricted_check_catches_what_a_values_file_can_ask_beyond_it() -> None:
    """The check above is a real one: an agent given IPC_LOCK and the node's network is refused, the others not."""
    objects = render(None, "agents.capabilities={IPC_LOCK}", "agents.hostNetwork=true")
    found = {name: restricted_violations(pod) for name, pod in pod_specs(objects)}
    assert found.pop("elastic-agent") == ["hostNetwork is set", "agent adds capabilities ['IPC_LOCK']"]
    assert not any(found.values()), found
    (agent,) = [pod for name, pod in pod_specs(objects) if name == "elastic-agent"]
    assert agent["dnsPolicy"] == "ClusterFirstWithHostNet"
