"""The command line shared by the four services: endpoints, intervals, keys, logging, the metrics endpoint, where
the hard state is kept (`--store`: the registry's SQLite database under `--state-dir`, or etcd, which makes the
process one replica of its service: replication/replica.py).

A service replicated over several control hosts (its endpoint an endpoint list, bus/config.py) runs one replica per
host, and each replica binds one address: `--bind HOST`, its own host's."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from elastic_control_plane.bus import metrics
from elastic_control_plane.bus.config import (
    DEFAULT_HOST,
    ConfigError,
    Endpoints,
    Timing,
    check_host,
    default_run_dir,
    endpoint_host,
    endpoint_list,
    tcp_endpoint,
)
from elastic_control_plane.bus.logs import setup_logging
from elastic_control_plane.bus.roles import SERVICE
from elastic_control_plane.bus.service import Service
from elastic_control_plane.bus.sockets import Security, SecurityError, private_dir
from elastic_control_plane.replication.election import ElectionTiming
from elastic_control_plane.replication.replica import StoreUnusable, serve_replica
from elastic_control_plane.replication.store_choice import StoreChoice
from elastic_control_plane.services.registry.store import StoreError

# (bind, connect, timing, security, log, replica): replica is None with the SQLite store; a service that keeps state
# on disk (the registry) is given its state_dir too.
Factory = Callable[..., Service]
# The endpoints a service binds besides its own: the notifier's events.
ALSO_BOUND = {"notifier": ("events",)}
BIND_NEEDED = "--bind is needed when --control names several hosts"


def bind_endpoints(connect: Endpoints, bind_host: str | None, setting: str, service: str) -> Endpoints:
    """The endpoints to bind: the connect endpoints, or the same tcp ports on `bind_host` (given by `setting`); of an
    endpoint list, the port of its endpoint on `bind_host` (else of its first). Without `bind_host`, an endpoint list
    of several endpoints that `service` binds is a `ConfigError`: a replica binds one of them."""
    if not bind_host:
        for name in (service, *ALSO_BOUND.get(service, ())):
            if len(endpoint_list(getattr(connect, name))) > 1:
                raise ConfigError(f"ELASTIC_{name.upper()}_ENDPOINT", getattr(connect, name), BIND_NEEDED)
        return connect
    check_host(setting, bind_host)
    return Endpoints(**{name: _on_bind_host(value, bind_host) for name, value in vars(connect).items()})


def _on_bind_host(value: str, bind_host: str) -> str:
    endpoints = endpoint_list(value)
    own = next((endpoint for endpoint in endpoints if endpoint_host(endpoint) == bind_host.strip("[]")), endpoints[0])
    return tcp_endpoint(bind_host, own.rpartition(":")[2]) if own.startswith("tcp://") else own


def replica_name(address: str) -> str:
    """How a replica is known in etcd: ELASTIC_REPLICA, else the address it binds, else (a wildcard bind, as in a
    container) its host name."""
    host = endpoint_host(address)
    return os.environ.get("ELASTIC_REPLICA") or (
        host if host not in (None, "0.0.0.0", "::", "*") else socket.gethostname()
    )


def service_command(
    name: str, factory: Factory, keeps_state: bool = False, options: Sequence[click.Option] = ()
) -> click.Command:
    """The service's command; the values of its own `options` go to `factory` as keyword arguments."""

    def run(
        bind: str | None,
        keys: Path | None,
        insecure: bool,
        metrics_port: str | None,
        store: str,
        state_dir: Path | None = None,
        **own: Any,
    ) -> None:
        log = setup_logging(name)
        try:
            timing = Timing.from_env()
            election = ElectionTiming(timing.lease_ttl)
            connect = Endpoints.from_env()
            source = click.get_current_context().get_parameter_source
            bind_to = bind_endpoints(
                connect, bind, "ELASTIC_BIND" if source("bind") is ParameterSource.ENVIRONMENT else "--bind", name
            )
            choice = StoreChoice.parse(
                "ELASTIC_STORE" if source("store") is ParameterSource.ENVIRONMENT else "--store", store
            ).with_keys(keys)
            if choice.kind == "etcd" and keys is not None and choice.tls is None:
                log.warning("etcd_without_tls", reason=f"{keys} has no etcd/ certificates (elasticctl keys generate)")
            security = Security(keys_dir=keys, insecure=insecure, role=SERVICE)
            address = getattr(bind_to, name)
            if metrics_port is not None:
                metrics.serve(
                    "--metrics-port",
                    endpoint_host(address) or DEFAULT_HOST,
                    metrics.metrics_port("--metrics-port", metrics_port),
                )
            if keeps_state and state_dir is None:
                state_dir = private_dir(default_run_dir(), "ELASTIC_RUN_DIR") / "state" / name
            state = {"state_dir": state_dir} if keeps_state else {}
            if choice.kind == "etcd":
                serve_replica(
                    name,
                    f"elastic_control_plane.services.{name}",
                    choice,
                    replica_name(address),
                    address,
                    election,
                    lambda replica: factory(bind_to, connect, timing, security, log, replica=replica, **state, **own),
                    log,
                )
                return
            service = factory(bind_to, connect, timing, security, log, replica=None, **state, **own)
        except (SecurityError, ValueError, OSError, StoreError, StoreUnusable) as exc:
            click.echo(f"{name}: {exc}", err=True)
            sys.exit(2)
        except Exception as exc:  # zmq.ZMQError on bind, mostly
            click.echo(f"{name}: cannot start: {exc}", err=True)
            sys.exit(2)
        metrics.watch_service(service)
        service.serve_forever()

    params: list[click.Parameter] = [
        click.Option(
            ["--bind"],
            envvar="ELASTIC_BIND",
            default=None,
            help="Interface to bind (default: the host of the endpoint); needed where --control names several hosts: "
            "this replica's host.",
        ),
        click.Option(
            ["--keys"],
            envvar="ELASTIC_KEYS",
            type=click.Path(path_type=Path, file_okay=False),
            default=None,
            help="CURVE key directory (elasticctl keys generate DIR).",
        ),
        click.Option(
            ["--insecure"], is_flag=True, envvar="ELASTIC_INSECURE", help="Allow binding beyond loopback without keys."
        ),
        click.Option(
            ["--metrics-port"],
            metavar="PORT",
            default=None,
            help="Serve Prometheus metrics over HTTP on this port, on the interface the service binds (default: off).",
        ),
        click.Option(
            ["--store"],
            envvar="ELASTIC_STORE",
            default="sqlite",
            show_default=True,
            metavar="sqlite|etcd://H:P,H:P,H:P[/PREFIX]",
            help="Where the control plane's hard state is kept. With etcd this process is one replica of the "
            "service: a standby until etcd elects it (run one per control host, each with --bind).",
        ),
    ]
    if keeps_state:
        params.append(
            click.Option(
                ["--state-dir"],
                envvar="ELASTIC_STATE_DIR",
                type=click.Path(path_type=Path, file_okay=False),
                default=None,
                help=f"Directory of the {name}'s durable state (default: $ELASTIC_RUN_DIR/state/{name}, "
                f"/tmp/elastic-UID/state/{name}).",
            )
        )
    params.extend(options)
    return click.Command(name, callback=run, params=params, help=f"Run the {name} service.")
