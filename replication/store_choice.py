"""Where the control plane keeps its hard state: `--store` / `ELASTIC_STORE`.

`sqlite` (the default) is the single-host control plane: the registry's
SQLite database under `--state-dir`, nothing else kept. `etcd://H:P,H:P,H:P[/PREFIX]`
puts the hard state in etcd under PREFIX (default `elastic`) and runs each
service as one replica of several (replication/replica.py). The client speaks
mutual TLS to etcd when the keys directory holds etcd's certificates
(`with_keys`: replication/etcd_tls.py), plain HTTP otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from elastic_control_plane.bus.config import ConfigError
from elastic_control_plane.replication.etcd import EtcdClient, parse_endpoints
from elastic_control_plane.replication.etcd_tls import EtcdTls

DEFAULT_PREFIX = "elastic"


@dataclass(frozen=True)
class StoreChoice:
    """`sqlite`, or etcd's client endpoints (`host:port`) and the prefix of the control plane's keys."""

    kind: str
    endpoints: tuple[str, ...] = ()
    prefix: str = DEFAULT_PREFIX
    tls: EtcdTls | None = None

    def with_keys(self, keys_dir: Path | None) -> StoreChoice:
        """The same store, over TLS with the etcd certificates of `keys_dir` where it holds them."""
        return replace(self, tls=EtcdTls.of_keys(keys_dir))

    def client(self, **options: Any) -> EtcdClient:
        """A client of the store's members (ssl.SSLError or OSError: its certificates cannot be used)."""
        tls = None if self.tls is None else self.tls.client_context()
        return EtcdClient(list(self.endpoints), tls=tls, **options)

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
