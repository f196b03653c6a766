"""`python -m elastic_control_plane.services.discovery`: run discovery; with --kubernetes-selector, its hosts are the
Ready pods of that label selector (services/discovery/kubernetes.py); with --kubernetes-token-audience, a host is
registered only by the pod of its name (services/discovery/pod_identity.py); with --slurm-job, the nodes of that
Slurm job that Slurm has not marked down or drained (services/discovery/slurm.py), and with --slurm-excluded the hosts
a requeued job runs without (slurm/exclusions.py), listed in `hosts` replies."""

from typing import Any

import click

from elastic_control_plane.bus.config import ConfigError, Endpoints, Timing
from elastic_control_plane.bus.sockets import Security
from elastic_control_plane.services.cli import service_command
from elastic_control_plane.services.discovery.collective_probe import DEFAULT_SLOW_FACTOR
from elastic_control_plane.services.discovery.kubernetes import ApiServer, PodSource, default_namespace
from elastic_control_plane.services.discovery.marks_log import MarksLog
from elastic_control_plane.services.discovery.pod_identity import PodIdentity
from elastic_control_plane.services.discovery.service import DiscoveryService
from elastic_control_plane.services.discovery.slurm import POLL as SLURM_POLL
from elastic_control_plane.services.discovery.slurm import SlurmSource
from elastic_control_plane.slurm import exclusions

POD_IDENTITY_NEEDS_BOTH = "pod identity checks need both --kubernetes-token-audience and --kubernetes-agent-account"
DISCOVERY_OPTIONS = [
    click.Option(
        ["--kubernetes-selector"],
        envvar="ELASTIC_KUBERNETES_SELECTOR",
        metavar="SELECTOR",
        default=None,
        help="Take the hosts from the Kubernetes API: the Ready pods matching this label selector (key=value,...), "
        "host = pod name, slots = annotation elastic/slots, else the pod's nvidia.com/gpu limit, else the agent's "
        "--slots. A job may not name a discovery script then.",
    ),
    click.Option(
        ["--kubernetes-namespace"],
        envvar="ELASTIC_KUBERNETES_NAMESPACE",
        metavar="NS",
        default=None,
        help="The pods' namespace (default: the service account's, else default).",
    ),
    click.Option(
        ["--kubernetes-token-audience"],
        envvar="ELASTIC_KUBERNETES_TOKEN_AUDIENCE",
        metavar="AUDIENCE",
        default=None,
        help="A host is who its pod is: an agent registers only with its pod's projected service-account token for "
        "this audience, which the TokenReview API must accept as the pod named as the host "
        "(services/discovery/pod_identity.py). With --kubernetes-agent-account.",
    ),
    click.Option(
        ["--kubernetes-agent-account"],
        envvar="ELASTIC_KUBERNETES_AGENT_ACCOUNT",
        metavar="NAME",
        default=None,
        help="With --kubernetes-token-audience: the service account of the agents' pods (in the pods' namespace).",
    ),
    click.Option(
        ["--slurm-job"],
        envvar="ELASTIC_SLURM_JOB",
        metavar="JOB",
        default=None,
        help="Take the hosts from Slurm: the nodes of this job and of the allocations that joined it, less those "
        "Slurm marks down or drained (elasticctl slurm's batch script sets it).",
    ),
    click.Option(
        ["--probe-slow-factor"],
        envvar="ELASTIC_PROBE_SLOW_FACTOR",
        type=click.FloatRange(min=1.0, min_open=True),
        default=DEFAULT_SLOW_FACTOR,
        show_default=True,
        help="A host entering the job whose share of the collective probe takes this many times the others' median "
        "is held back (agents run with --collective-probe).",
    ),
    click.Option(
        ["--slurm-poll"],
        envvar="ELASTIC_SLURM_POLL",
        type=click.FloatRange(min=0.1),
        default=SLURM_POLL,
        show_default=True,
        metavar="S",
        help="With --slurm-job, seconds between two looks at the job's nodes (four RPCs to slurmctld each).",
    ),
    click.Option(
        ["--slurm-excluded"],
        envvar="ELASTIC_SLURM_EXCLUDED",
        metavar="JSON",
        default=None,
        help="With --slurm-job, the hosts the requeued job runs without: [{host, requeue, reason}] (the batch "
        "script's driver sets it from STATE/JOB/exclude.json); `hosts` replies list them, as `elasticctl status`.",
    ),
]


def discovery(
    bind: Endpoints,
    connect: Endpoints,
    timing: Timing,
    security: Security,
    log: Any,
    replica: Any,
    kubernetes_selector: str | None,
    kubernetes_namespace: str | None,
    kubernetes_token_audience: str | None,
    kubernetes_agent_account: str | None,
    slurm_job: str | None,
    probe_slow_factor: float,
    slurm_poll: float,
    slurm_excluded: str | None,
) -> DiscoveryService:
    """The service; with a selector, watching the pods it matches; with a Slurm job, its nodes."""
    pods: PodSource | SlurmSource | None = None
    if kubernetes_selector and slurm_job:
        raise ConfigError("--slurm-job", slurm_job, "discovery takes its hosts from Kubernetes or Slurm, not both")
    if slurm_excluded is not None and not slurm_job:
        raise ConfigError("--slurm-excluded", slurm_excluded, "only with --slurm-job")
    if not kubernetes_agent_account and kubernetes_token_audience:
        raise ConfigError("--kubernetes-token-audience", kubernetes_token_audience, POD_IDENTITY_NEEDS_BOTH)
    if not kubernetes_token_audience and kubernetes_agent_account:
        raise ConfigError("--kubernetes-agent-account", kubernetes_agent_account, POD_IDENTITY_NEEDS_BOTH)
    if slurm_job:
        try:
            excluded = exclusions.checked(slurm_excluded) if slurm_excluded is not None else []
        except ValueError as exc:
            raise ConfigError("--slurm-excluded", slurm_excluded, str(exc)) from None
        pods = SlurmSource(slurm_job, log.bind(source="slurm"), poll=slurm_poll, excluded=excluded)
    namespace = kubernetes_namespace or default_namespace()
    if kubernetes_selector:
        pods = PodSource(ApiServer.from_env(), namespace, kubernetes_selector, log.bind(source="kubernetes"))
    identity = None
    if kubernetes_token_audience and kubernetes_agent_account:
        api, identity_log = ApiServer.from_env(), log.bind(source="pod_identity")
        identity = PodIdentity(api, namespace, kubernetes_agent_account, kubernetes_token_audience, identity_log)
    return DiscoveryService(
        bind.discovery,
        connect.notifier,
        timing,
        marks_log=MarksLog(replica) if replica is not None else None,
        pods=pods,
        pod_identity=identity,
        probe_slow_factor=probe_slow_factor,
        security=security,
        log=log,
    )


main = service_command("discovery", discovery, options=DISCOVERY_OPTIONS)

if __name__ == "__main__":
    main()
