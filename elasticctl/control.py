"""ControlPlane: the CLI's clients of the services, with errors turned into one clear line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bus.client import Client, ServiceError, Unreachable, incarnation_id
from bus.config import Endpoints
from bus.sockets import Security


class CommandError(Exception):
    """Something the CLI reports as one line and a non-zero exit."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class ControlPlane:
    def __init__(self, endpoints: Endpoints, keys: Path | None = None, timeout: float = 2.0) -> None:
        self.endpoints = endpoints
        sender = incarnation_id("elasticctl")
        security = Security(keys_dir=keys)
        self._clients = {
            name: Client(getattr(endpoints, name), sender, security=security, timeout=timeout / 2, deadline=timeout)
            for name in ("discovery", "rendezvous", "registry", "notifier")
        }

    def call(self, service: str, msg_type: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            return self._clients[service].request(msg_type, body or {}).body
        except Unreachable as exc:
            raise CommandError(f"cannot reach the {service} at {exc.endpoint}: is the control plane up? (no reply)") from None
        except ServiceError as exc:
            raise CommandError(exc.message or exc.code) from None

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
