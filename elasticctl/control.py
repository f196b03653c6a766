"""ControlPlane: the CLI's clients of the services, with errors turned into one clear line.

A service that does not answer raises `ControlPlaneUnreachable` (a `CommandError`), so a command that only makes
one request ends with one line, and a command that follows the job (`elasticctl run`, `status --watch`,
`events --follow`) can catch it and ride the outage through (elasticctl/outage.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import zmq

from elastic_control_plane.bus.client import Client, ServiceError, Unreachable, incarnation_id
from elastic_control_plane.bus.config import Endpoints
from elastic_control_plane.bus.pubsub import Subscription
from elastic_control_plane.bus.sockets import Security


class CommandError(Exception):
    """Something the CLI reports as one line and a non-zero exit."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ControlPlaneUnreachable(CommandError):
    """A service gave no reply within the deadline; `silent_since` is when the unanswered request was sent."""

    def __init__(self, service: str, endpoint: str, silent_since: float) -> None:
        super().__init__(f"cannot reach the {service} at {endpoint}: is the control plane up? (no reply)")
        self.service = service
        self.endpoint = endpoint
        self.silent_since = silent_since


class ControlPlane:
    def __init__(self, endpoints: Endpoints, keys: Path | None = None, timeout: float = 2.0) -> None:
        self.endpoints = endpoints
        self.keys_dir = keys
        self._sender = incarnation_id("elasticctl")
        self._security = Security(keys_dir=keys)
        self._clients = {
            name: Client(
                getattr(endpoints, name), self._sender, security=self._security, timeout=timeout / 2, deadline=timeout
            )
            for name in ("discovery", "rendezvous", "registry", "notifier")
        }

    def call(self, service: str, msg_type: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        sent_at = time.monotonic()
        try:
            return self._clients[service].request(msg_type, body or {}).body
        except Unreachable as exc:
            raise ControlPlaneUnreachable(service, exc.endpoint, sent_at) from None
        except ServiceError as exc:
            raise CommandError(exc.message or exc.code) from None

    def subscription(self) -> Subscription:
        """A subscription to the notifier's events, with this plane's keys; the caller closes it."""
        return Subscription(
            zmq.Context.instance(), self.endpoints.events, self.endpoints.notifier, self._sender, self._security
        )

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
