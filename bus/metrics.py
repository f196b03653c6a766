"""Prometheus metrics of a process: the ones every Service has, and the HTTP endpoint that serves them all.

Each service and the agent serves its metrics on `--metrics-port PORT` (off
by default), on the interface the service binds (loopback by default; the
agent, which binds only ipc, on its `--advertise-addr`): `serve` starts an
HTTP server (a daemon thread) with prometheus-client's app on its default
registry, and the process's health (bus/health.py) at /healthz and /readyz.
The registry holds the metrics below, the ones a process defines next to the
code that updates them (services/discovery/service.py,
services/registry/metrics.py, agent/agent.py) and prometheus-client's process
metrics.

Every Service counts the requests it dispatches (`count_message`, called by
`bus/service.py`) in `elastic_messages_total{service, type, outcome}`; `type`
is one of the message types the service handles, or `unknown` for any other
type and for a message that cannot be decoded, so no peer can add label
values. `watch_service` adds the service's queue depths, parked requests and
reply-cache entries, read by the HTTP thread with `len()` only (the service
loop mutates those dicts meanwhile: iterating them from the HTTP thread could
fail). `AsyncClient` (bus/client.py) keeps `elastic_client_requests_in_flight`
up to date from the service loop itself.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import Counter, Gauge, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from elastic_control_plane.bus import health
from elastic_control_plane.bus.config import ConfigError

UNKNOWN_TYPE = "unknown"
HANDLED, REFUSED, FAILED, MALFORMED = "handled", "refused", "failed", "malformed"

MESSAGES = Counter(
    "elastic_messages",
    "Requests a service dispatched, by outcome: handled (answered or parked by its handler), refused (an error "
    "reply the handler chose, or a type the service does not handle), failed (the handler raised: an internal "
    "error reply), malformed (not a valid message; type is unknown).",
    ["service", "type", "outcome"],
)
PARKED_REQUESTS = Gauge(
    "elastic_parked_requests", "Requests parked by a service, waiting for their answer.", ["service"]
)
REPLY_CACHE_ENTRIES = Gauge(
    "elastic_reply_cache_entries", "Answers a service keeps to answer a retried request again.", ["service"]
)
CLIENT_REQUESTS_IN_FLIGHT = Gauge(
    "elastic_client_requests_in_flight",
    "Requests a service's non-blocking client sent and has no reply for yet.",
    ["service", "endpoint"],
)


def count_message(service: str, msg_type: str, outcome: str) -> None:
    MESSAGES.labels(service, msg_type, outcome).inc()


def metrics_port(setting: str, value: str) -> int:
    """`value` as a TCP port (1-65535), else `ConfigError` naming `setting`."""
    if not value.isdigit():
        raise ConfigError(setting, value, "not a port number")
    if not 1 <= int(value) <= 65535:
        raise ConfigError(setting, value, f"port {int(value)} is out of range (1-65535)")
    return int(value)


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # a scrape every few seconds is not news
        pass


def _routed(metrics_app: Callable[..., Any]) -> Callable[..., Any]:
    """The metrics app, with the health paths (bus/health.py) answered first."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        check = health.CHECKS.get(environ.get("PATH_INFO", ""))
        if check is None:
            return metrics_app(environ, start_response)
        reason = check()
        start_response("200 OK" if reason is None else "503 Service Unavailable", [("Content-Type", "text/plain")])
        return [f"{reason or 'ok'}\n".encode()]

    return app


def serve(setting: str, host: str, port: int) -> None:
    """Serve this process's metrics, and its health (bus/health.py: /healthz, /readyz), over HTTP on `host`:`port`
    (given by `setting`) from a daemon thread; `ConfigError` when the port cannot be bound (taken, or `host` is not an
    interface of this machine)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        server = make_server(address[0], port, _routed(make_wsgi_app()), server_class, handler_class=_QuietHandler)
    except OSError as exc:
        raise ConfigError(setting, str(port), f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()


def watch_service(service: Any) -> None:
    """Export the queue depths of the process's service, read when scraped (`len()` only)."""
    PARKED_REQUESTS.labels(service.name).set_function(lambda: len(service._parked))
    REPLY_CACHE_ENTRIES.labels(service.name).set_function(lambda: len(service._replied))
