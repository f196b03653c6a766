"""`elastic-agent --host NAME --slots N --control HOST[,HOST...]`: run the agent of one host."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from elastic_control_plane.agent.agent import AgentService
from elastic_control_plane.agent.fork_server import enabled as fork_server_enabled
from elastic_control_plane.agent.gpus import check_slots, check_standby, default_slots, gpu_devices
from elastic_control_plane.agent.host_health import HealthSettings, check_settings, visible_gpus
from elastic_control_plane.agent.host_options import AgentConfig, host_options
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.bus import health, metrics
from elastic_control_plane.bus.config import Endpoints, Timing, control_hosts, default_run_dir, is_loopback
from elastic_control_plane.bus.logs import setup_logging
from elastic_control_plane.bus.roles import AGENT
from elastic_control_plane.bus.sockets import Security, SecurityError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--host", envvar="ELASTIC_HOST", required=True, help="This host's name, as the job knows it.")
@host_options
@click.option(
    "--control",
    envvar="ELASTIC_CONTROL",
    default=None,
    help="Host(s) of the control plane, comma-separated for a replicated control plane (default 127.0.0.1; "
    "ELASTIC_*_ENDPOINT override each service).",
)
@click.option(
    "--keys",
    envvar="ELASTIC_KEYS",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="CURVE key directory.",
)
@click.option(
    "--insecure",
    is_flag=True,
    envvar="ELASTIC_INSECURE",
    help="Allow a control plane off loopback without keys (plaintext; no server is authenticated).",
)
@click.option(
    "--advertise-addr",
    envvar="ELASTIC_ADVERTISE_ADDR",
    default=None,
    help="Address other hosts reach this host's workers at (default: 127.0.0.1 when every control host is a loopback "
    "address, else this host's name).",
)
@click.option(
    "--drain-timeout",
    type=float,
    default=60.0,
    show_default=True,
    help="On SIGTERM, seconds to wait for workers to leave at a commit.",
)
@click.option(
    "--no-fork-server",
    is_flag=True,
    help="Spawn every worker (a fresh interpreter) instead of forking it from the host's fork server; also "
    "ELASTIC_FORK_SERVER=0.",
)
@click.option(
    "--metrics-port",
    metavar="PORT",
    default=None,
    help="Serve Prometheus metrics over HTTP on this port, on the advertised address (default: off).",
)
@click.option(
    "--health-check",
    metavar="CMD",
    default=None,
    help="A shell command run on this host before it enters the job (and when discovery asks again); exit 0 means "
    "healthy. Built-in checks (free /dev/shm and memory, visible GPUs) always run.",
)
@click.option(
    "--health-check-timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds --health-check may run; past them it is killed and the check fails.",
)
@click.option(
    "--health-check-interval",
    type=float,
    default=30.0,
    show_default=True,
    help="While the checks fail, seconds between two runs.",
)
@click.option("--health-min-shm", type=float, default=16.0, show_default=True, help="MiB /dev/shm must have free.")
@click.option(
    "--health-min-memory", type=float, default=256.0, show_default=True, help="MiB of memory that must be available."
)
@click.option(
    "--collective-probe",
    envvar="ELASTIC_COLLECTIVE_PROBE",
    is_flag=True,
    help="Before this host enters the job, it runs a short timed all-reduce with the other hosts entering; a host "
    "much slower than the others is held back (discovery's --probe-slow-factor).",
)
def main(
    host: str,
    slots: int | None,
    share_gpus: bool,
    control: str | None,
    keys: Path | None,
    insecure: bool,
    advertise_addr: str | None,
    drain_timeout: float,
    standby: int | None,
    no_fork_server: bool,
    metrics_port: str | None,
    health_check: str | None,
    health_check_timeout: float,
    health_check_interval: float,
    health_min_shm: float,
    health_min_memory: float,
    collective_probe: bool,
) -> None:
    """Run the elastic agent of one host."""
    log = setup_logging("agent", host=host)
    if not host or "/" in host or host.startswith("."):
        click.echo(f"elastic-agent: invalid host name {host!r}", err=True)
        sys.exit(2)
    gpus = len(gpu_devices())
    slots = default_slots(gpus) if slots is None else slots
    from_env = click.get_current_context().get_parameter_source("control") is ParameterSource.ENVIRONMENT
    control_setting = "ELASTIC_CONTROL" if from_env else "--control"
    try:
        endpoints = Endpoints.from_env(control, control_setting)
        if advertise_addr is None:
            local = not control or all(map(is_loopback, control_hosts(control_setting, control)))
            advertise_addr = "127.0.0.1" if local else socket.getfqdn()
        check_slots(slots, gpus, share_gpus)
        health_settings = HealthSettings(
            health_check,
            health_check_timeout,
            health_check_interval,
            health_min_shm,
            health_min_memory,
            visible_gpus() if gpus else 0,
            advertise_addr if collective_probe else None,
        )
        check_settings(health_settings)
        if standby is not None:
            check_standby(standby, slots)
        if metrics_port is not None:
            health.ready_when(lambda: "starting")
            metrics.serve("--metrics-port", advertise_addr, metrics.metrics_port("--metrics-port", metrics_port))
        timing = Timing.from_env()
        INTERVALS.check(timing)
        config = AgentConfig(
            host,
            slots,
            default_run_dir(),
            advertise_address=advertise_addr,
            share_gpus=share_gpus,
            standby=standby,
            fork_server=not no_fork_server and fork_server_enabled(os.environ),
            drain_timeout=drain_timeout,
            health=health_settings,
        )
        security = Security(keys_dir=keys, insecure=insecure, role=AGENT, host=host)
        for endpoint in vars(endpoints).values():
            security.check_connect(endpoint)
        agent = AgentService(config, endpoints, timing, security, log=log)
        health.ready_when(agent.readiness)
    except (SecurityError, ValueError) as exc:
        click.echo(f"elastic-agent: {exc}", err=True)
        sys.exit(2)
    except Exception as exc:
        click.echo(f"elastic-agent: cannot start: {exc}", err=True)
        sys.exit(2)
    metrics.watch_service(agent)
    agent.serve_forever()


if __name__ == "__main__":
    main()
