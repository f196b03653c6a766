"""Config of the control plane: endpoints and intervals. Flags > `ELASTIC_*` environment > defaults.

Click commands read flags with `envvar=` set to the names below, so the
precedence is the same everywhere; code that has no flags (libworker) reads
the environment through `Endpoints.from_env` / `Timing.from_env`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORTS = {"discovery": 5550, "rendezvous": 5551, "registry": 5552, "notifier": 5553, "events": 5554}


@dataclass(frozen=True)
class Endpoints:
    """Where the four services listen. `events` is the notifier's publish socket."""

    discovery: str
    rendezvous: str
    registry: str
    notifier: str
    events: str

    @classmethod
    def on_host(cls, host: str = DEFAULT_HOST) -> Endpoints:
        return cls(**{name: f"tcp://{host}:{port}" for name, port in DEFAULT_PORTS.items()})

    @classmethod
    def from_env(cls, host: str | None = None) -> Endpoints:
        """Defaults on `host` (or ELASTIC_CONTROL), each overridable by ELASTIC_<NAME>_ENDPOINT."""
        base = cls.on_host(host or os.environ.get("ELASTIC_CONTROL") or DEFAULT_HOST)
        overrides = {
            f.name: os.environ[f"ELASTIC_{f.name.upper()}_ENDPOINT"]
            for f in fields(cls)
            if os.environ.get(f"ELASTIC_{f.name.upper()}_ENDPOINT")
        }
        return replace(base, **overrides)

    def as_env(self) -> dict[str, str]:
        return {f"ELASTIC_{f.name.upper()}_ENDPOINT": getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Timing:
    """Intervals in seconds. Tests shorten them through the environment."""

    heartbeat: float = 1.0
    missed_heartbeats: int = 3
    discovery_poll: float = 1.0
    driver_tick: float = 0.1
    request_timeout: float = 2.0
    collective_timeout: float = 60.0

    @property
    def lost_after(self) -> float:
        return self.heartbeat * self.missed_heartbeats

    @classmethod
    def from_env(cls) -> Timing:
        values: dict[str, float | int] = {}
        for f in fields(cls):
            raw = os.environ.get(f"ELASTIC_{f.name.upper()}")
            if raw:
                try:
                    values[f.name] = int(raw) if f.type == "int" else float(raw)
                except ValueError:
                    raise ValueError(f"ELASTIC_{f.name.upper()}={raw!r} is not a number") from None
        return cls(**values)  # type: ignore[arg-type]

    def as_env(self) -> dict[str, str]:
        return {f"ELASTIC_{f.name.upper()}": str(getattr(self, f.name)) for f in fields(self)}
