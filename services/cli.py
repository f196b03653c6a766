"""The command line shared by the four services: endpoints, intervals, keys, logging, the metrics endpoint, and for
a service that keeps state on disk (the registry), its state directory.

A service replicated over several control hosts (its endpoint an endpoint list, bus/config.py) runs one replica per
host, and each replica binds one address: `--bind HOST`, its own host's."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click
from click.core import ParameterSource

from bus import metrics
from bus.config import (
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
from bus.logs import setup_logging
from bus.service import Service
from bus.sockets import Security, SecurityError
from services.registry.store import StoreError

Factory = Callable[..., Service]  # (bind, connect, timing, security, log), and state_dir for a service with state
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


def service_command(name: str, factory: Factory, keeps_state: bool = False) -> click.Command:
    def run(
        bind: str | None, keys: Path | None, insecure: bool, metrics_port: str | None, state_dir: Path | None = None
    ) -> None:
        log = setup_logging(name)
        try:
            timing = Timing.from_env()
            connect = Endpoints.from_env()
            from_env = click.get_current_context().get_parameter_source("bind") is ParameterSource.ENVIRONMENT
            bind_to = bind_endpoints(connect, bind, "ELASTIC_BIND" if from_env else "--bind", name)
            security = Security(keys_dir=keys, insecure=insecure)
            if metrics_port is not None:
                metrics.serve(
                    "--metrics-port",
                    endpoint_host(getattr(bind_to, name)) or DEFAULT_HOST,
                    metrics.metrics_port("--metrics-port", metrics_port),
                )
            state = {"state_dir": state_dir or default_run_dir() / "state" / name} if keeps_state else {}
            service = factory(bind_to, connect, timing, security, log, **state)
        except (SecurityError, ValueError, OSError, StoreError) as exc:
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
    return click.Command(name, callback=run, params=params, help=f"Run the {name} service.")
