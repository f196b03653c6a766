"""The rendered pods run for real, without a cluster: the chart's control-plane containers, two agent pods and the
Job, each started as a local process from its rendered command and environment ($(POD_NAME) and $(POD_IP)
substituted, host names and ports moved to 127.0.0.1 and free ports) with CURVE keys: each pod holds only the key files
its role's volume maps, as in a cluster; gated on the rendered readiness probes; the
job trains to its end, through the eviction of the Job's pod (its new pod attaches to the run) and the deletion of an
agent pod (SIGTERM: the agent drains)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_control_plane.bus.config import DEFAULT_PORTS
from testing.harness import Cluster, free_ports, wait_for
from tests.deploy.conftest import render
from tests.deploy.pod_files import KEYS_SECRET, POD_IDENTITY_ENV, make_secrets, mount_secrets, on_this_machine
from tests.deploy.test_chart_objects import component, containers, environment
from tests.deploy.test_chart_replicated_local import ready

COMMANDS = {"python": [sys.executable], "elastic-agent": [sys.executable, "-m", "elastic_control_plane.agent.main"]}
COMMANDS["elasticctl"] = [sys.executable, "-m", "elastic_control_plane.elasticctl.main"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    instance = Cluster(tmp_path)
    try:
        yield instance
    finally:
        instance.close()


def local(argv: list[str], env: dict[str, str], ports: dict[int, int]) -> list[str]:
    """A rendered command on this machine: $(VAR) from its environment, our interpreter, endpoints on loopback and
    every --metrics-port on a free port."""
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in argv]
    argv = [*COMMANDS.get(argv[0], argv[:1]), *argv[1:]]
    for i, arg in enumerate(argv):
        if arg.startswith("tcp://"):
            argv[i] = f"tcp://127.0.0.1:{ports[int(arg.rpartition(':')[2])]}"
        if argv[i - 1] == "--metrics-port":
            (argv[i],) = map(str, free_ports(1))
    return argv


def local_env(
    cluster: Cluster, rendered: dict[str, str], ports: dict[int, int], tmp: Path, kubernetes_api: str | None = None
) -> dict[str, str]:
    """A container's rendered environment over the test cluster's (its fast timing, run and shared-memory directories),
    its endpoints moved to loopback, the registry's volume a directory of this test; discovery from the Kubernetes API
    pointed at `kubernetes_api` (a loopback API server), or, without one, left out with the pods' identities (the
    agents' heartbeats find them)."""
    env = dict(cluster.env)
    for name, value in rendered.items():
        if name.endswith("_ENDPOINT"):
            value = ",".join(f"tcp://127.0.0.1:{ports[int(e.rpartition(':')[2])]}" for e in value.split(","))
        env[name] = value
    env["ELASTIC_BIND"] = "127.0.0.1"
    if "ELASTIC_STATE_DIR" in env:
        env["ELASTIC_STATE_DIR"] = str(tmp / "state")
    if kubernetes_api is not None and "ELASTIC_KUBERNETES_SELECTOR" in env:
        env["ELASTIC_KUBERNETES_API"] = kubernetes_api
    else:
        for name in ("ELASTIC_KUBERNETES_SELECTOR", "ELASTIC_KUBERNETES_NAMESPACE", *POD_IDENTITY_ENV):
            env.pop(name, None)
    return env


def test_the_rendered_pods_run_a_job_through_an_agent_pod_deletion(cluster: Cluster, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        "security: {keysSecret: elastic-keys}\n"
        "job: {enabled: true, minNp: 1, command: [python, examples/train.py, --epochs, '30', --samples, '512']}\n"
    )
    objects = render(str(values))
    secrets = make_secrets(tmp_path / "secrets", ["127.0.0.1"])
    cluster.env["ELASTIC_KEYS"] = str(secrets[KEYS_SECRET])  # the test's own calls, as an operator
    ports = {
        DEFAULT_PORTS[name]: int(endpoint.rpartition(":")[2]) for name, endpoint in vars(cluster.endpoints).items()
    }
    by_component: dict[str, tuple[dict[str, Any], dict[str, str], dict[str, Any]]] = {}
    for workload, container in containers(objects):
        by_component[component(workload)] = (container, environment(container), workload["spec"]["template"]["spec"])

    def pod_env(name: str, pod: str, extra: dict[str, str] | None = None) -> dict[str, str]:
        """A pod's environment here, its keys volume the files the chart maps for its role and nothing more."""
        container, rendered, spec = by_component[name]
        mounts = mount_secrets(spec, container, secrets, tmp_path / "mounts" / pod)
        rendered = {key: on_this_machine(value, mounts) for key, value in {**rendered, **(extra or {})}.items()}
        return local_env(cluster, rendered, ports, tmp_path)

    for name in ("notifier", "discovery", "rendezvous", "registry"):
        container = by_component[name][0]
        env = pod_env(name, f"elastic-{name}-0")
        cluster.spawn(name, local(container["command"], env, ports), env=env)
        probe = local(container["readinessProbe"]["exec"]["command"], env, ports)
        wait_for(lambda: subprocess.run(probe, env=env, capture_output=True).returncode == 0, 30, f"{name} ready")
    container = by_component["agent"][0]
    readiness, liveness = (container[probe]["httpGet"] for probe in ("readinessProbe", "livenessProbe"))
    assert readiness["port"] == liveness["port"] == "metrics"
    for pod in ("elastic-agent-0", "elastic-agent-1"):
        env = pod_env("agent", pod, {"POD_NAME": pod, "POD_IP": "127.0.0.1"})
        argv = local(container["command"], env, ports)
        cluster.spawn(f"agent-{pod}", argv, env=env)
        metrics = f"http://127.0.0.1:{argv[argv.index('--metrics-port') + 1]}"
        wait_for(lambda: ready(metrics + readiness["path"]), 60, f"{pod}'s readiness probe")
        assert ready(metrics + liveness["path"])
    registered = {h["host"] for h in cluster.call("discovery", "hosts")["all"]}
    assert registered == {"elastic-agent-0", "elastic-agent-1"}, "a Ready agent pod is registered"
    hosts = lambda: {h["host"] for h in cluster.call("discovery", "hosts")["all"] if h["state"] == "active"}  # noqa: E731
    # Registered, it may still warm up (its fork server importing torch, seconds on a loaded machine) before active.
    wait_for(lambda: hosts() == {"elastic-agent-0", "elastic-agent-1"}, 60, "both agent pods active")
    container = by_component["job"][0]
    env = pod_env("job", "elastic-job")
    evicted = cluster.spawn("elasticctl-run", local(container["command"], env, ports), env=env)
    wait_for(lambda: cluster.job()["state"] == "running" and cluster.job()["size"] == 2, 60, "the job on both pods")
    first = cluster.job()
    # The Job's pod is evicted (SIGKILL: no cancel) and its new pod runs the same command: it attaches to the run.
    assert cluster.stop("elasticctl-run", signal.SIGKILL, timeout=10) == -signal.SIGKILL and evicted.poll() is not None
    job = cluster.spawn("elasticctl-run-2", local(container["command"], env, ports), env=env)
    wait_for(lambda: "already: following it" in cluster.output("elasticctl-run-2"), 30, "the new pod to attach")
    # Deleting a pod sends SIGTERM: the agent drains at a commit and the job goes on with the other pod.
    assert cluster.stop("agent-elastic-agent-1", signal.SIGTERM, timeout=30) == 0
    assert cluster.wait_job_end(job, 120) == 0, cluster.output("elasticctl-run-2")
    ended = cluster.job()
    assert ended["state"] == "succeeded" and ended["round"] >= 2 and ended["size"] == 1, "it finished on one pod"
    assert ended["job"] == first["job"], "the new submitter followed the job, it did not submit another"
