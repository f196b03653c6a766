"""The rendered pods with discovery from the Kubernetes API, without a cluster: the chart's containers run as local
processes (tests/deploy/test_chart_local.py), and discovery watches the agent pods in a loopback API server that
speaks the real protocol (testing/kube_apiserver.py). A pod counts once it is Ready: an agent whose pod is not
Ready yet waits outside the job, and is in its next round within seconds of the Ready event. Deleting a pod (its
deletionTimestamp, then SIGTERM to its agent) drains it; a pod that vanishes with its agent (SIGKILL) is a lost host.
The job trains to its end through both. Each agent registers with its pod's token, which discovery reviews with the
API (services/discovery/pod_identity.py), as the chart sets them up."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

from elastic_control_plane.bus.config import DEFAULT_PORTS
from testing.harness import Cluster, wait_for
from testing.kube_apiserver import KubeApiServer
from tests.deploy.conftest import render
from tests.deploy.test_chart_local import cluster, local, local_env  # noqa: F401 (the fixture)
from tests.deploy.test_chart_objects import FIELDS, component, containers, environment, pod_labels

PODS = ("elastic-agent-0", "elastic-agent-1", "elastic-agent-2")
BATCHES = 2000  # 40 s at least: a pod made Ready, one drained and one lost, each followed by a new round


def test_discovery_from_the_api_follows_ready_deleted_and_vanished_pods_through_a_job(
    cluster: Cluster,  # noqa: F811
    tmp_path: Path,
) -> None:
    values = tmp_path / "values.yaml"
    job = [sys.executable, "tests/workers/counter.py", "--batches", str(BATCHES), "--step-delay", "0.02"]
    values.write_text(
        "security: {insecure: true}\n"  # this test is about discovery; the keys' test is test_chart_local's
        f"job: {{enabled: true, minNp: 1, command: {job + ['--log-dir', str(tmp_path / 'train')]}}}\n"
    )
    objects = render(str(values))
    ports = {DEFAULT_PORTS[name]: int(e.rpartition(":")[2]) for name, e in vars(cluster.endpoints).items()}
    by_component: dict[str, tuple[dict[str, Any], dict[str, str], dict[str, str]]] = {}
    for workload, container in containers(objects):
        by_component[component(workload)] = (container, environment(container), pod_labels(workload))
    api = KubeApiServer(namespace=FIELDS["metadata.namespace"])
    try:
        for name in ("notifier", "discovery", "rendezvous", "registry"):
            container, rendered, _ = by_component[name]
            env = local_env(cluster, rendered, ports, tmp_path, api.url)
            cluster.spawn(name, local(container["command"], env, ports), env=env)
        assert "ELASTIC_KUBERNETES_SELECTOR" in by_component["discovery"][1], "the chart points discovery at the pods"
        for name in ("notifier", "discovery", "rendezvous", "registry"):
            wait_for(lambda s=name: cluster.call(s, "ping", timeout=0.5), 30, f"{name} to answer")

        container, rendered, labels = by_component["agent"]

        identity = by_component["discovery"][1]  # the audience and the agents' account discovery checks tokens for
        audience, account = identity["ELASTIC_KUBERNETES_TOKEN_AUDIENCE"], identity["ELASTIC_KUBERNETES_AGENT_ACCOUNT"]

        def start_pod(pod: str) -> None:
            api.add_pod(pod, labels)
            env = local_env(cluster, {**rendered, "POD_NAME": pod, "POD_IP": "127.0.0.1"}, ports, tmp_path)
            token = tmp_path / f"{pod}.token"  # the pod's projected token, as the kubelet writes it
            token.write_text(api.tokens.issue(pod, audience, account, node=f"node-of-{pod}"))
            env["ELASTIC_POD_TOKEN_FILE"] = str(token)
            cluster.spawn(f"agent-{pod}", local(container["command"], env, ports), env=env)
            wait_for(lambda: pod in {h["host"] for h in cluster.call("discovery", "hosts")["all"]}, 30, f"{pod} up")

        def available() -> set[str]:
            return {name for name, _ in cluster.call("discovery", "hosts")["available"]}

        for pod in PODS[:2]:
            start_pod(pod)
        assert available() == set(), "an agent whose pod is not Ready is not used"
        for pod in PODS[:2]:
            api.set_ready(pod, True)
        wait_for(lambda: available() == set(PODS[:2]), 10, "the two Ready pods available")
        container_job, rendered_job, _ = by_component["job"]
        env = local_env(cluster, rendered_job, ports, tmp_path)
        run = cluster.spawn("elasticctl-run", local(container_job["command"], env, ports), env=env)
        wait_for(lambda: (j := cluster.job())["state"] == "running" and j["size"] == 2, 60, "the job on two pods")

        start_pod(PODS[2])
        assert PODS[2] not in available()
        api.set_ready(PODS[2], True)
        wait_for(lambda: cluster.job()["size"] == 3, 60, "the Ready pod in the job's next round")

        api.mark_deleting(PODS[1])  # kubectl delete pod: the deletionTimestamp, then SIGTERM to its containers
        wait_for(lambda: PODS[1] not in available(), 5, "the deleted pod out of the host list")
        assert cluster.stop(f"agent-{PODS[1]}", signal.SIGTERM, timeout=30) == 0, "the agent drained and exited 0"
        api.delete_pod(PODS[1])
        wait_for(lambda: (j := cluster.job())["size"] == 2 and j["state"] == "running", 60, "the job without it")

        resets = cluster.job()["resets"]
        api.delete_pod(PODS[2])  # the node is gone: its pod vanishes with its agent
        cluster.processes[f"agent-{PODS[2]}"].send_signal(signal.SIGKILL)
        wait_for(lambda: (j := cluster.job())["size"] == 1 and j["resets"] > resets, 60, "the job without the lost pod")

        assert cluster.wait_job_end(run, 180) == 0, cluster.output("elasticctl-run")
        assert cluster.job()["state"] == "succeeded"
    finally:
        api.close()
