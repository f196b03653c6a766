"""The replicated layout's rendered pods run for real, without a cluster: the 3 etcd members from their rendered
command (this machine's etcd; member i on 127.0.0.(i+1); TLS with the certificates their Secret maps), and both replicas
of each service from theirs (replica j on 127.0.0.(j+1), named by its pod name as a StatefulSet pod's host name names
it; CURVE and etcd's client certificate from the files their keys volume maps, nothing more). Each service answers
through its rendered endpoint list, the readiness probes answer (the standbys' too, so a rolling update never waits on
one; etcd's without a certificate), and when the active registry pod is killed the other takes over."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_control_plane.bus.config import DEFAULT_PORTS
from elastic_control_plane.bus.lifetime import die_with_parent
from elastic_control_plane.replication.etcd_member import etcd_binary
from elastic_control_plane.replication.store_choice import StoreChoice
from testing.harness import free_ports, wait_for
from tests.deploy.conftest import NAMESPACE, REPO, render
from tests.deploy.pod_files import KEYS_SECRET, POD_IDENTITY_ENV, make_secrets, mount_secrets, on_this_machine
from tests.deploy.test_chart_objects import SERVICES, environment
from tests.integration.test_compose import ping, stop
from tests.integration.test_compose_replicated import registry_takes_over

CHART_VALUES = REPO / "deploy/helm/elastic/ci/daemonset-values.yaml"  # the replicated layout, 2 replicas


def pods(objects: list[dict[str, Any]]) -> Iterator[tuple[str, str, dict[str, Any], dict[str, Any]]]:
    """(StatefulSet name, pod name, pod spec, container) of every pod of the control plane's StatefulSets."""
    for obj in objects:
        if obj["kind"] == "StatefulSet" and obj["metadata"]["name"] != "elastic-agent":
            spec = obj["spec"]["template"]["spec"]
            for i in range(obj["spec"]["replicas"]):
                yield obj["metadata"]["name"], f"{obj['metadata']['name']}-{i}", spec, spec["containers"][0]


@pytest.fixture
def plane(tmp_path: Path) -> Iterator[dict[str, Any]]:
    objects = render(str(CHART_VALUES))
    client_port, peer_port, metrics_port, *service_ports = free_ports(3 + len(DEFAULT_PORTS))
    ports = {2379: client_port, 2380: peer_port, 2381: metrics_port, **dict(zip(DEFAULT_PORTS.values(), service_ports))}
    secrets = make_secrets(tmp_path / "secrets", ["127.0.0.1", "127.0.0.2", "127.0.0.3"])

    def local(text: str, pod: str) -> str:
        """A rendered argument or value on this machine: pods' stable names on loopback addresses, free ports."""
        text = text.replace("$(POD_NAME)", pod)
        text = re.sub(rf"([a-z-]+)-(\d+)\.\1\.{NAMESPACE}\.svc", lambda m: f"127.0.0.{int(m.group(2)) + 1}", text)
        text = text.replace("0.0.0.0", f"127.0.0.{int(pod.rpartition('-')[2]) + 1}")
        return re.sub(r":(\d{4})\b", lambda m: f":{ports.get(int(m.group(1)), int(m.group(1)))}", text)

    processes: dict[str, subprocess.Popen[bytes]] = {}
    metrics: dict[str, str] = {}
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "HOME": str(tmp_path)}
    members = {pod: (spec, container) for owner, pod, spec, container in pods(objects) if owner == "elastic-etcd"}

    def on_member(text: str, pod: str) -> str:
        """A member's argument here: its volumes (data, config, certificates) directories of the test's own."""
        mounts = mount_secrets(*members[pod], secrets, tmp_path / "mounts" / pod)
        text = on_this_machine(local(text, pod), mounts).replace("/data/etcd", str(tmp_path / pod))
        return text.replace("/config/etcd.json", str(tmp_path / f"{pod}.json"))

    def configure(pod: str) -> subprocess.Popen[bytes]:
        """The pod's init container: etcd_join writes the member's config."""
        (init,) = members[pod][0]["initContainers"]
        argv = [sys.executable if arg == "python" else on_member(arg, pod) for arg in init["command"]]
        with open(tmp_path / f"{pod}-init.log", "ab") as log:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def start_member(pod: str) -> None:
        container = members[pod][1]
        argv = [etcd_binary(), *(on_member(arg, pod) for arg in container["command"][1:])]
        with open(tmp_path / f"{pod}.log", "ab") as log:
            processes[pod] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent())
        probe = container["readinessProbe"]["httpGet"]  # /health on the metrics port, without a certificate
        assert probe["port"] == "metrics"
        metrics[pod] = f"http://127.0.0.{int(pod.rpartition('-')[2]) + 1}:{metrics_port}{probe['path']}"

    def replace_member(pod: str) -> None:
        """The member's pod comes back on an empty volume: its data is gone, its init container and etcd run again."""
        stop(processes.pop(pod))
        shutil.rmtree(tmp_path / pod)
        assert configure(pod).wait(timeout=60) == 0, (tmp_path / f"{pod}-init.log").read_text()
        start_member(pod)

    try:
        starting = [configure(pod) for pod in members]  # a StatefulSet's Parallel pods: the three at once
        assert [init.wait(timeout=60) for init in starting] == [0, 0, 0]
        for pod in members:
            start_member(pod)
        for owner, pod, spec, container in pods(objects):
            if owner == "elastic-etcd":
                continue
            mounts = mount_secrets(spec, container, secrets, tmp_path / "mounts" / pod)
            argv = [on_this_machine(local(arg, pod), mounts) for arg in container["command"]]
            service_env = {
                **env,
                **{name: on_this_machine(local(value, pod), mounts) for name, value in environment(container).items()},
                "ELASTIC_REPLICA": pod,  # a StatefulSet pod's host name, which names it when it binds 0.0.0.0
            }
            for name in ("ELASTIC_KUBERNETES_SELECTOR", *POD_IDENTITY_ENV):  # no API server here: discovery from
                service_env.pop(name, None)  # heartbeats, and no pod identity to review
            argv = [sys.executable if arg == "python" else arg for arg in argv]
            (port,) = free_ports(1)
            argv[argv.index("--metrics-port") + 1] = str(port)
            probe = container["readinessProbe"]["httpGet"]
            assert probe["port"] == "metrics"
            metrics[pod] = f"http://{service_env['ELASTIC_BIND']}:{port}{probe['path']}"
            with open(tmp_path / f"{pod}.log", "ab") as log:
                processes[pod] = subprocess.Popen(
                    argv, env=service_env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=die_with_parent()
                )
        registry = next(c for owner, _, _, c in pods(objects) if owner == "elastic-registry")
        yield {
            "replace_member": replace_member,
            "init_log": lambda pod: (tmp_path / f"{pod}-init.log").read_text(),
            "keys": secrets[KEYS_SECRET],
            "processes": processes,
            "metrics": metrics,
            "endpoints": {name: local(value, "x-0") for name, value in environment(registry).items()},
            "etcd": local(environment(registry)["ELASTIC_STORE"], "x-0").removeprefix("etcd://").split(","),
        }
    finally:
        # The replicas first, while etcd still answers their resignation; then the members.
        for _, process in sorted(processes.items(), key=lambda item: "etcd" in item[0]):
            stop(process)


def active_gauge(url: str, service: str) -> float | None:
    """elastic_replica_active{service} as a replica's /metrics says it."""
    with urllib.request.urlopen(url, timeout=2) as answer:
        text = answer.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "elastic_replica_active" and sample.labels.get("service") == service:
                return sample.value
    return None


def ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


def test_the_rendered_replicated_pods_elect_one_replica_each_and_the_other_takes_over(plane: dict[str, Any]) -> None:
    endpoints = plane["endpoints"]
    for name in SERVICES:
        answer = ping(endpoints[f"ELASTIC_{name.upper()}_ENDPOINT"], time.monotonic() + 60, plane["keys"])
        assert answer["service"] == name
    for pod, url in plane["metrics"].items():
        wait_for(lambda url=url: ready(url), 20, f"{pod}'s readiness probe")
    for name in SERVICES:  # what the alert on a service without an active replica reads: one active, one standby
        roles = [active_gauge(url, name) for pod, url in plane["metrics"].items() if pod.startswith(f"elastic-{name}-")]
        assert sorted(roles) == [0.0, 1.0], (name, roles)
    registry_takes_over(
        plane["etcd"],
        plane["processes"],
        ("elastic-registry-0", "elastic-registry-1"),
        endpoints["ELASTIC_REGISTRY_ENDPOINT"],
        plane["keys"],
    )


def test_a_member_whose_volume_is_lost_rejoins_and_the_control_plane_goes_on(plane: dict[str, Any]) -> None:
    """etcd-1's pod comes back on an empty volume: its init container finds the running cluster listing it, removes
    it and adds it back, and it joins with the others' data, where a fresh bootstrap would crash-loop; then etcd-0
    too, so that a majority of the members have been replaced, and the registry still answers through etcd."""
    client = StoreChoice.parse("etcd", "etcd://" + ",".join(plane["etcd"])).with_keys(plane["keys"]).client()
    try:
        wait_for(lambda: len([m for m in client.members() if m.name]) == 3, 60, "three members running")
        for pod in ("elastic-etcd-1", "elastic-etcd-0"):
            before = {m.name: m.id for m in client.members()}
            plane["replace_member"](pod)
            assert "joins the running cluster" in plane["init_log"](pod)
            wait_for(lambda: ready(plane["metrics"][pod]), 60, f"{pod} healthy again")
            after = {m.name: m.id for m in client.members() if m.name}
            assert after.keys() == before.keys() and after[pod] != before[pod], (before, after)
        assert ping(plane["endpoints"]["ELASTIC_REGISTRY_ENDPOINT"], time.monotonic() + 60, plane["keys"])
    finally:
        client.close()
