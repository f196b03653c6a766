"""The chart's part in "a host is who its pod is" (services/discovery/pod_identity.py): each agent pod mounts a
projected token of the agents' own ServiceAccount (no rights) for discovery's audience, short-lived, and names it in
ELASTIC_POD_TOKEN_FILE; discovery checks tokens for that same audience and account, and may create tokenreviews (a
ClusterRole of that one verb, bound to its ServiceAccount alone). Turned off, none of it is rendered."""

from __future__ import annotations

from typing import Any

from tests.deploy.conftest import CHART, NAMESPACE, helm, render
from tests.deploy.test_chart_objects import environment, workloads


def pod_spec(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (workload,) = [w for w in workloads(objects) if w["metadata"]["name"] == name]
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def token_volume(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The agent pod's projected service-account token, with where the container mounts it."""
    for volume in spec.get("volumes", []):
        for source in volume.get("projected", {}).get("sources", []):
            if "serviceAccountToken" in source:
                (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
                return {**source["serviceAccountToken"], "mount": mount}
    return None


def test_each_agent_pod_proves_itself_with_a_short_lived_token_for_discoverys_audience() -> None:
    objects = render()
    agent, discovery = pod_spec(objects, "elastic-agent"), pod_spec(objects, "elastic-discovery")
    token = token_volume(agent)
    assert token is not None and token["audience"] == "elastic-discovery"
    assert token["expirationSeconds"] == 600, "short-lived: the kubelet renews it"
    assert token["mount"]["readOnly"] is True
    agent_env, discovery_env = environment(agent["containers"][0]), environment(discovery["containers"][0])
    assert agent_env["ELASTIC_POD_TOKEN_FILE"] == f"{token['mount']['mountPath']}/{token['path']}"
    assert discovery_env["ELASTIC_KUBERNETES_TOKEN_AUDIENCE"] == token["audience"]
    assert agent["serviceAccountName"] == discovery_env["ELASTIC_KUBERNETES_AGENT_ACCOUNT"] == "elastic-agent"
    assert agent["automountServiceAccountToken"] is False, "no token the API itself would take"

    (account,) = [o for o in objects if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "elastic-agent"]
    assert account["automountServiceAccountToken"] is False
    bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    assert all(s["name"] == "elastic-discovery" for b in bindings for s in b["subjects"]), "the agents get no rights"


def test_discovery_may_create_tokenreviews_and_nothing_else_cluster_wide() -> None:
    objects = render()
    (role,) = [o for o in objects if o["kind"] == "ClusterRole"]
    assert role["rules"] == [
        {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
    ]
    (binding,) = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "elastic-discovery", "namespace": NAMESPACE}]
    assert NAMESPACE in role["metadata"]["name"], "cluster-scoped names: one release per namespace does not collide"


def test_an_audience_and_an_account_of_ones_own_reach_both_sides() -> None:
    objects = render(
        None,
        "discovery.kubernetes.podIdentity.audience=team-a-elastic",
        "agents.serviceAccountName=team-a-agents",
    )
    agent, discovery = pod_spec(objects, "elastic-agent"), pod_spec(objects, "elastic-discovery")
    discovery_env = environment(discovery["containers"][0])
    assert (
        (token_volume(agent) or {})["audience"]
        == discovery_env["ELASTIC_KUBERNETES_TOKEN_AUDIENCE"]
        == "team-a-elastic"
    )
    assert agent["serviceAccountName"] == discovery_env["ELASTIC_KUBERNETES_AGENT_ACCOUNT"] == "team-a-agents"


def test_turned_off_nothing_of_it_is_rendered() -> None:
    objects = render(None, "discovery.kubernetes.podIdentity.enabled=false")
    agent, discovery = pod_spec(objects, "elastic-agent"), pod_spec(objects, "elastic-discovery")
    assert token_volume(agent) is None and "serviceAccountName" not in agent
    assert "ELASTIC_POD_TOKEN_FILE" not in environment(agent["containers"][0])
    assert not {"ELASTIC_KUBERNETES_TOKEN_AUDIENCE", "ELASTIC_KUBERNETES_AGENT_ACCOUNT"} & set(
        environment(discovery["containers"][0])
    )
    assert not [o for o in objects if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_a_token_living_less_than_the_api_allows_is_refused() -> None:
    result = helm(
        "template", "elastic", str(CHART), "--set", "security.insecure=true",
        "--set", "discovery.kubernetes.podIdentity.expirationSeconds=60",
        check=False,
    )  # fmt: skip
    assert result.returncode != 0 and "expirationSeconds" in result.stderr
