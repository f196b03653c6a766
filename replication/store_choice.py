"""Where the control plane keeps its hard state: `--store` / `ELASTIC_STORE`.

`sqlite` (the default) is the single-host control plane: the registry's
SQLite database under `--state-dir`, nothing else kept. `etcd://H:P,H:P,H:P[/PREFIX]`
puts the hard state in etcd under PREFIX (default `elastic`) and runs each
service as one replica of several (replication/replica.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_control_plane.bus.config import ConfigError
from elastic_control_plane.replication.etcd import parse_endpoints

DEFAULT_PREFIX = "elastic"


@dataclass(frozen=True)
class StoreChoice:
    """`sqlite`, or etcd's client endpoints (`host:port`) and the prefix of the control plane's keys."""

    kind: str
    endpoints: tuple[str, ...] = ()
    prefix: str = DEFAULT_PREFIX

    @classmethod
    def parse(cls, setting: str, text: str) -> StoreChoice:
        """`sqlite` or `etcd://H:P,H:P[/PREFIX]`, else a `ConfigError` naming `setting`."""
        if text in ("", "sqlite"):
            return cls("sqlite")
        scheme, sep, rest = text.partition("://")
        if not sep or scheme != "etcd":
            raise ConfigError(setting, text, "want sqlite or etcd://HOST:PORT,HOST:PORT,...[/PREFIX]")
        members, _, prefix = rest.partition("/")
        prefix = prefix.strip("/") or DEFAULT_PREFIX
        try:
            endpoints = parse_endpoints(members)
        except ValueError as exc:
            raise ConfigError(setting, text, str(exc)) from None
        return cls("etcd", tuple(endpoints), prefix)
