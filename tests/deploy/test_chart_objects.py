"""The chart's rendered objects against the project itself: selectors match pod labels, Service ports are the CLI's
defaults, every container's command parses with the project's real click commands and its environment with the real
config checks, GPU limits equal --slots, and the replicated layout names every replica and etcd member."""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

import click
import pytest
import yaml

from elastic_control_plane.bus.config import DEFAULT_PORTS, Endpoints, Timing, endpoint_list
from elastic_control_plane.replication.store_choice import StoreChoice
from elastic_control_plane.services.cli import bind_endpoints
from tests.deploy.conftest import NAMESPACE, REPO, render

Obj = dict[str, Any]
WORKLOAD_KINDS = ("StatefulSet", "DaemonSet", "Job")
SERVICES = ("discovery", "rendezvous", "registry", "notifier")
# What the downward API gives a pod, for parsing its command.
FIELDS = {"metadata.name": "elastic-agent-0", "status.podIP": "10.1.2.3", "metadata.namespace": NAMESPACE}


def merged(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        return {key: merged(base.get(key), over.get(key)) if key in over else base[key] for key in base | over}
    return over


def chart_values(ci_values: str) -> dict[str, Any]:
    """The values a render used: the chart's values.yaml under the ci file's."""
    defaults = yaml.safe_load((REPO / "deploy/helm/elastic/values.yaml").read_text())
    return merged(defaults, yaml.safe_load(open(ci_values)))


def workloads(objects: list[Obj]) -> list[Obj]:
    return [obj for obj in objects if obj["kind"] in WORKLOAD_KINDS]


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def containers(objects: list[Obj]) -> list[tuple[Obj, Obj]]:
    return [(w, c) for w in workloads(objects) for c in w["spec"]["template"]["spec"]["containers"]]


def environment(container: Obj) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        env[item["name"]] = item["value"] if "value" in item else FIELDS[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def etcd_flags(etcd: Obj) -> list[str]:
    """An etcd member's flags, as its pod's init container hands them to etcd_join (replication/etcd_join.py)."""
    (init,) = etcd["spec"]["template"]["spec"]["initContainers"]
    command = init["command"]
    assert command[:3] == ["python", "-m", "elastic_control_plane.replication.etcd_join"]
    return command[command.index("--") + 1 :]


def component(workload: Obj) -> str:
    return pod_labels(workload)["app.kubernetes.io/component"]


def test_selectors_match_pod_labels(ci_values: str) -> None:
    objects = render(ci_values)
    for workload in workloads(objects):
        labels = pod_labels(workload)
        for key in ("name", "instance", "component"):
            assert f"app.kubernetes.io/{key}" in labels
        selector = workload["spec"].get("selector", {}).get("matchLabels")
        if workload["kind"] != "Job":
            assert selector and selector.items() <= labels.items(), workload["metadata"]["name"]
    for service in [obj for obj in objects if obj["kind"] == "Service"]:
        selector = service["spec"]["selector"].items()
        (target,) = [w for w in workloads(objects) if selector <= pod_labels(w).items()]
        named = {p["name"] for c in target["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in named, f"{service['metadata']['name']}: no container port {port['targetPort']}"
        if target["kind"] == "StatefulSet":
            assert target["spec"]["serviceName"] == service["metadata"]["name"]
    for budget in [obj for obj in objects if obj["kind"] == "PodDisruptionBudget"]:
        selector = budget["spec"]["selector"]["matchLabels"].items()
        assert len([w for w in workloads(objects) if selector <= pod_labels(w).items()]) == 1


def test_service_ports_are_the_cli_defaults(ci_values: str) -> None:
    objects = render(ci_values)
    services = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Service"}
    for name in SERVICES:
        ports = {port["name"]: port["port"] for port in services[f"elastic-{name}"]["spec"]["ports"]}
        assert ports[name] == DEFAULT_PORTS[name]
        if name == "notifier":
            assert ports["events"] == DEFAULT_PORTS["events"]
    for _, container in containers(objects):
        for variable, value in environment(container).items():
            match = re.fullmatch(r"ELASTIC_([A-Z]+)_ENDPOINT", variable)
            if match:
                ports = {int(endpoint.rpartition(":")[2]) for endpoint in endpoint_list(value)}
                assert ports == {DEFAULT_PORTS[match.group(1).lower()]}, f"{variable}={value}"


def click_command(argv: list[str]) -> tuple[click.Command, str, list[str]]:
    if argv[:2] == ["python", "-m"] and argv[2].removeprefix("elastic_control_plane.services.") in SERVICES:
        return importlib.import_module(f"{argv[2]}.__main__").main, argv[2], argv[3:]
    if argv[0] == "elastic-agent":
        return importlib.import_module("elastic_control_plane.agent.main").main, argv[0], argv[1:]
    if argv[0] == "elasticctl":
        return importlib.import_module("elastic_control_plane.elasticctl.main").cli, argv[0], argv[1:]
    raise AssertionError(f"a container runs {argv}, which is none of the project's commands")


def parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> click.Context:
    """Parse a container's command as Kubernetes would run it ($(VAR) from its environment) with the project's real
    click command and the container's environment (options read ELASTIC_* variables), without running it."""
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in argv]
    command, name, args = click_command(argv)
    for variable in [v for v in os.environ if v.startswith("ELASTIC_") and v != "ELASTIC_SHM_DIR"]:
        monkeypatch.delenv(variable)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    context = command.make_context(name, args, resilient_parsing=False)
    if isinstance(command, click.Group):
        sub = command.get_command(context, args[0])
        assert sub is not None, f"{name} has no subcommand {args[0]}"
        context = sub.make_context(args[0], args[1:], parent=context, resilient_parsing=False)
    return context


def test_every_container_command_parses_with_the_real_cli(ci_values: str, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = render(ci_values)
    values = chart_values(ci_values)
    seen = set()
    for workload, container in containers(objects):
        env = environment(container)
        if component(workload) == "etcd":
            continue
        assert container["image"] == "elastic-control-plane:0.1.0"
        params = parse(container["command"], env, monkeypatch).params
        endpoints = Endpoints.from_env()  # every endpoint list passes the project's own checks
        Timing.from_env()
        kind = component(workload)
        seen.add(kind)
        if kind in SERVICES:
            metrics = next(p["containerPort"] for p in container["ports"] if p["name"] == "metrics")
            assert params["metrics_port"] == str(metrics)
            bind_endpoints(endpoints, params["bind"], "ELASTIC_BIND", kind)
            assert params["insecure"] is (not values["security"]["keysSecret"])
            if params["store"] != "sqlite":
                assert StoreChoice.parse("ELASTIC_STORE", params["store"]).kind == "etcd"
            elif kind == "registry":
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert str(params["state_dir"]) in mounts, "the registry's SQLite is on its volume"
        elif kind == "agent":
            assert params["host"] == FIELDS["metadata.name"] and params["advertise_addr"] == FIELDS["status.podIP"]
            assert params["slots"] == values["agents"]["slots"]
        else:
            assert kind == "job" and params["min_np"] == values["job"]["minNp"]
            assert list(params["command"]) == values["job"]["command"]
    assert seen >= {*SERVICES, "agent"}


def test_a_misspelt_option_does_not_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsing above is a real check: an option the agent does not have is refused."""
    with pytest.raises(click.UsageError):
        parse(["elastic-agent", "--host", "h", "--slot", "2"], {}, monkeypatch)


@pytest.mark.parametrize("name", ["gpu-values.yaml", "daemonset-values.yaml", "cpu-values.yaml"])
def test_gpu_limits_equal_slots(name: str) -> None:
    objects = render(str(REPO / "deploy/helm/elastic/ci" / name))
    (agent,) = [(w, c) for w, c in containers(objects) if component(w) == "agent"]
    workload, container = agent
    command = container["command"]
    slots = int(command[command.index("--slots") + 1])
    limits = container["resources"].get("limits", {})
    if name == "cpu-values.yaml":
        assert "nvidia.com/gpu" not in limits and slots == 2
    else:
        assert limits["nvidia.com/gpu"] == slots > 1
    assert container["resources"]["requests"], "the agent's resources are requested"


def test_agents_drain_within_their_grace_period_with_shm_in_memory(ci_values: str) -> None:
    objects = render(ci_values)
    (workload,) = [w for w in workloads(objects) if component(w) == "agent"]
    pod = workload["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    drain = float(container["command"][container["command"].index("--drain-timeout") + 1])
    assert pod["terminationGracePeriodSeconds"] > drain
    (shm,) = [v for v in pod["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    if workload["kind"] == "StatefulSet":
        assert workload["spec"]["podManagementPolicy"] == "Parallel"
        term = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= pod_labels(workload).items()
    for w, c in containers(objects):
        assert c["resources"]["requests"], f"{w['metadata']['name']}: resources requested"


def test_discovery_watches_exactly_the_agents_pods(ci_values: str) -> None:
    objects = render(ci_values)
    (discovery,) = [c for w, c in containers(objects) if component(w) == "discovery"]
    env = environment(discovery)
    if "ELASTIC_KUBERNETES_SELECTOR" not in env:
        assert "single-host" in ci_values
        return
    assert env["ELASTIC_KUBERNETES_NAMESPACE"] == NAMESPACE
    selector = dict(term.split("=") for term in env["ELASTIC_KUBERNETES_SELECTOR"].split(","))
    chosen = [component(w) for w in workloads(objects) if selector.items() <= pod_labels(w).items()]
    assert chosen == ["agent"]


def test_the_replicated_layout_names_every_replica_and_etcd_member() -> None:
    objects = render(str(REPO / "deploy/helm/elastic/ci/replicated-values.yaml"))
    sets = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "StatefulSet"}
    services = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "Service"}
    (agent,) = [c for w, c in containers(objects) if component(w) == "agent"]
    env = environment(agent)
    for name in SERVICES:
        replicas = sets[f"elastic-{name}"]["spec"]["replicas"]
        assert replicas == 3
        hosts = [f"elastic-{name}-{i}.elastic-{name}.{NAMESPACE}.svc" for i in range(replicas)]
        assert env[f"ELASTIC_{name.upper()}_ENDPOINT"] == ",".join(f"tcp://{h}:{DEFAULT_PORTS[name]}" for h in hosts)
        spec = services[f"elastic-{name}"]["spec"]
        assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
        affinity = sets[f"elastic-{name}"]["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
        assert affinity["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == "kubernetes.io/hostname"
        assert not sets[f"elastic-{name}"]["spec"].get("volumeClaimTemplates"), "state is in etcd"
    etcd = sets["elastic-etcd"]
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["volumeClaimTemplates"]
    retained = {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert etcd["spec"]["persistentVolumeClaimRetentionPolicy"] == retained, "an uninstall keeps the job's state"
    members = [f"elastic-etcd-{i}.elastic-etcd.{NAMESPACE}.svc:2379" for i in range(3)]
    (control,) = [c for w, c in containers(objects) if component(w) == "registry"]
    assert environment(control)["ELASTIC_STORE"] == "etcd://" + ",".join(members)
    flags = dict(arg.partition("=")[::2] for arg in etcd_flags(etcd))
    assert flags["--initial-cluster"] == ",".join(
        f"elastic-etcd-{i}=https://elastic-etcd-{i}.elastic-etcd.{NAMESPACE}.svc:2380" for i in range(3)
    )
    assert flags["--auto-compaction-mode"] == "periodic" and flags["--auto-compaction-retention"] == "10m"
    (claim,) = etcd["spec"]["volumeClaimTemplates"]
    size = claim["spec"]["resources"]["requests"]["storage"]
    assert size.endswith("Gi") and int(size[:-2]) * 2**30 >= 2 * int(flags["--quota-backend-bytes"]), (
        "etcd's volume holds twice its quota: compacted pages are reused, the file shrinks only when defragmented"
    )
    budgets = {obj["metadata"]["name"]: obj["spec"] for obj in objects if obj["kind"] == "PodDisruptionBudget"}
    assert {name: spec["maxUnavailable"] for name, spec in budgets.items()} == {
        f"elastic-{name}": 1 for name in ("etcd", "agent", *SERVICES)
    }, "a drain takes one member, replica or agent at a time"
    compose = yaml.safe_load((REPO / "docker-compose.replicated.yml").read_text())
    compose_flags = {arg.partition("=")[0] for arg in compose["services"]["etcd-1"]["command"][1:]}
    assert set(flags) == compose_flags, "the same etcd flags as docker-compose.replicated.yml"


def test_the_single_layout_runs_one_pod_per_service_the_registry_on_a_volume() -> None:
    objects = render()
    sets = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "StatefulSet"}
    assert {name: sets[f"elastic-{name}"]["spec"]["replicas"] for name in SERVICES} == dict.fromkeys(SERVICES, 1)
    (claim,) = sets["elastic-registry"]["spec"]["volumeClaimTemplates"]
    retained = {"whenDeleted": "Retain", "whenScaled": "Retain"}
    assert sets["elastic-registry"]["spec"]["persistentVolumeClaimRetentionPolicy"] == retained
    (registry,) = sets["elastic-registry"]["spec"]["template"]["spec"]["containers"]
    assert {"name": claim["metadata"]["name"], "mountPath": environment(registry)["ELASTIC_STATE_DIR"]} in registry[
        "volumeMounts"
    ]
    probe = registry["readinessProbe"]["exec"]["command"]
    assert probe == ["python", "-m", "elastic_control_plane.bus.ping", f"tcp://127.0.0.1:{DEFAULT_PORTS['registry']}"]
    assert "elastic-etcd" not in sets
