"""Config of the control plane: endpoints and intervals. Flags > `ELASTIC_*` environment > defaults.

Click commands read flags with `envvar=` set to the names below, so the
precedence is the same everywhere; code that has no flags (libworker) reads
the environment through `Endpoints.from_env` / `Timing.from_env`.

Every value is checked here, once, while the config is built and before any
socket is made: an endpoint is `tcp://HOST:PORT` (port 1-65535) or
`ipc://PATH`, a host is a host name or an IP address. A bad one raises
`ConfigError`, whose message names the setting and its value.

A replicated control plane runs each service on every control host, and only its active replica binds. Clients are
given every control host (`--control A,B,C`), and each setting of an endpoint then holds an endpoint list: the
service's endpoints on every control host, comma-separated, in order (`tcp://A:5551,tcp://B:5551,tcp://C:5551`);
`bus.sockets.client_socket` connects to all of them. One endpoint is an endpoint list of one. Whether a name
resolves is not a question of config (DNS may answer later, as it does when
containers start): `unresolved_hosts` asks, for those who report it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from dataclasses import dataclass, fields, replace
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORTS = {"discovery": 5550, "rendezvous": 5551, "registry": 5552, "notifier": 5553, "events": 5554}
ENDPOINT_FORMS = "want tcp://HOST:PORT or ipc://PATH"
LIST_SEPARATOR = ","
_HOST_NAME = re.compile(
    r"(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62}))*\.?"
)


class ConfigError(ValueError):
    """A setting (flag or environment variable) holds a value that cannot be used; the message names both."""

    def __init__(self, setting: str, value: str, problem: str) -> None:
        super().__init__(f"{setting}={value!r}: {problem}")
        self.setting = setting
        self.value = value
        self.problem = problem


def _host_problem(host: str) -> str | None:
    """Why `host` is not a host name or an IP address (IPv6 with or without brackets), or None."""
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if ":" in literal or re.fullmatch(r"[0-9.]+", literal):
        try:
            ipaddress.ip_address(literal)
            return None
        except ValueError:
            if ":" not in literal:
                return f"{host!r} is not an IP address"
    elif host == literal and _HOST_NAME.fullmatch(host):
        return None
    return f"{host!r} is not a host name or an IP address"


def check_host(setting: str, host: str) -> str:
    """`host` if it is a host name or an IP address, else `ConfigError` naming `setting`."""
    problem = _host_problem(host) if host else "no host"
    if problem:
        raise ConfigError(setting, host, problem)
    return host


def check_endpoint(setting: str, endpoint: str) -> str:
    """`endpoint` if it is `tcp://HOST:PORT` (port 1-65535) or `ipc://PATH`, else `ConfigError` naming `setting`."""
    scheme, sep, address = endpoint.partition("://")
    if not sep:
        raise ConfigError(setting, endpoint, f"not an endpoint ({ENDPOINT_FORMS})")
    if scheme == "ipc":
        if not address:
            raise ConfigError(setting, endpoint, "no path (want ipc://PATH)")
        return endpoint
    if scheme != "tcp":
        raise ConfigError(setting, endpoint, f"scheme {scheme!r} is not supported ({ENDPOINT_FORMS})")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ConfigError(setting, endpoint, "no port (want tcp://HOST:PORT)")
    if not 1 <= int(port) <= 65535:
        raise ConfigError(setting, endpoint, f"port {int(port)} is out of range (1-65535)")
    problem = _host_problem(host) if host else "no host (want tcp://HOST:PORT)"
    if problem:
        raise ConfigError(setting, endpoint, problem)
    return endpoint


def endpoint_list(value: str) -> list[str]:
    """The endpoints of an endpoint list (`tcp://A:5551,tcp://B:5551`), in order; one endpoint is a list of one."""
    return value.split(LIST_SEPARATOR)


def check_endpoint_list(setting: str, value: str) -> str:
    """`value` if every endpoint of the list is good (`check_endpoint`) and none is named twice, else `ConfigError`
    naming `setting` and the whole value."""
    endpoints = endpoint_list(value)
    if len(endpoints) == 1:
        return check_endpoint(setting, value)
    for endpoint in endpoints:
        try:
            check_endpoint(setting, endpoint)
        except ConfigError as exc:
            raise ConfigError(setting, value, f"in {endpoint!r}: {exc.problem}") from None
    _refuse_twice_named(setting, value, endpoints)
    return value


def control_hosts(setting: str, value: str) -> list[str]:
    """The hosts of `--control A,B,C` (each a host name or an IP address, with or without `:PORT`, none named twice),
    else `ConfigError`."""
    return [host for host, _ in control_addresses(setting, value)]


def control_addresses(setting: str, value: str) -> list[tuple[str, int]]:
    """`--control A,B:6550,[::1]:6560` as (host, base port) pairs: the services listen on the base port (discovery's,
    DEFAULT_PORTS' first when none is given) and the four after it, in DEFAULT_PORTS' order; else `ConfigError`."""
    items = value.split(LIST_SEPARATOR)
    addresses = [split_control_address(setting, value, item) for item in items]
    twice = next((items[i] for i, address in enumerate(addresses) if address in addresses[:i]), None)
    if twice is not None:
        raise ConfigError(setting, value, f"{twice!r} is named twice")
    return addresses


def split_control_address(setting: str, value: str, item: str) -> tuple[str, int]:
    """One control host of `value`: `HOST`, `HOST:PORT` or `[IPV6]:PORT` (a bare IPv6 address has no port)."""
    host, port = item, ""
    if item.startswith("[") and "]:" in item:
        host, _, port = item.rpartition(":")
    elif item.count(":") == 1:
        host, _, port = item.partition(":")
    problem = _host_problem(host) if host else "an empty host"
    if not problem and port:
        highest = 65535 - (len(DEFAULT_PORTS) - 1)
        if not port.isdigit() or not 1 <= int(port) <= highest:
            problem = f"port {port!r} of {item!r} is not a number from 1 to {highest} (the first of five)"
    if problem:
        raise ConfigError(setting, value, problem)
    return host, int(port) if port else DEFAULT_PORTS["discovery"]


def control_address(host: str, base_port: int) -> str:
    """What `--control` takes for the services on `host` from `base_port` (the host alone on the default ports)."""
    if base_port == DEFAULT_PORTS["discovery"]:
        return host
    return f"[{host}]:{base_port}" if ":" in host else f"{host}:{base_port}"


def _refuse_twice_named(setting: str, value: str, items: list[str]) -> None:
    twice = next((item for i, item in enumerate(items) if item in items[:i]), None)
    if twice is not None:
        raise ConfigError(setting, value, f"{twice!r} is named twice")


def is_loopback(host: str) -> bool:
    """Is `host` this machine's loopback (`localhost`, 127.x.x.x, ::1)?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def tcp_endpoint(host: str, port: int | str) -> str:
    """`tcp://HOST:PORT`, an IPv6 host in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def endpoint_host(endpoint: str) -> str | None:
    """The host of one tcp endpoint (without IPv6 brackets); None for ipc."""
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")


def unresolved_hosts(endpoint_lists: list[str]) -> list[str]:
    """The hosts of the endpoint lists that DNS does not resolve (each once, in order). Blocks while DNS answers."""
    endpoints = [endpoint for value in endpoint_lists for endpoint in endpoint_list(value)]
    unresolved: list[str] = []
    for host in dict.fromkeys(filter(None, map(endpoint_host, endpoints))):
        try:
            socket.getaddrinfo(host, None)
        except (socket.gaierror, UnicodeError):
            unresolved.append(host)
    return unresolved


@dataclass(frozen=True)
class Endpoints:
    """Where the four services listen, each an endpoint list. `events` is the notifier's publish socket."""

    discovery: str
    rendezvous: str
    registry: str
    notifier: str
    events: str

    @classmethod
    def on_host(cls, host: str = DEFAULT_HOST) -> Endpoints:
        return cls.on_hosts([host])

    @classmethod
    def on_hosts(cls, hosts: list[str] | list[tuple[str, int]]) -> Endpoints:
        """Each service on every host, in order: an endpoint list per service. A host alone listens on DEFAULT_PORTS;
        a (host, base port) pair on the base port and the four after it."""
        first = DEFAULT_PORTS["discovery"]
        pairs = [(host, first) if isinstance(host, str) else host for host in hosts]
        return cls(
            **{
                name: LIST_SEPARATOR.join(tcp_endpoint(host, base + port - first) for host, base in pairs)
                for name, port in DEFAULT_PORTS.items()
            }
        )

    @classmethod
    def from_env(cls, control: str | None = None, control_setting: str = "--control") -> Endpoints:
        """Defaults on the control hosts `control` (`A,B,C`, given by `control_setting`; else ELASTIC_CONTROL), each
        overridable by ELASTIC_<NAME>_ENDPOINT (an endpoint list); every value checked (`ConfigError`)."""
        if not control:
            control, control_setting = os.environ.get("ELASTIC_CONTROL") or DEFAULT_HOST, "ELASTIC_CONTROL"
        base = cls.on_hosts(control_addresses(control_setting, control))
        chosen = {}
        for f in fields(cls):
            setting = f"ELASTIC_{f.name.upper()}_ENDPOINT"
            value = os.environ.get(setting)
            chosen[f.name] = check_endpoint_list(setting, value) if value else getattr(base, f.name)
        return cls(**chosen)

    def as_env(self) -> dict[str, str]:
        return {f"ELASTIC_{f.name.upper()}_ENDPOINT": getattr(self, f.name) for f in fields(self)}

    def values(self) -> list[str]:
        """Every endpoint list, in field order."""
        return [getattr(self, f.name) for f in fields(self)]


@dataclass(frozen=True)
class Timing:
    """Intervals in seconds, each set by its variable (ELASTIC_ and the name in capitals; tests shorten them), checked
    together when read: all positive, the driver's tick within a heartbeat, and the collective timeout longer than
    the heartbeats that find a host lost."""

    heartbeat: float = 1.0
    missed_heartbeats: int = 3
    discovery_poll: float = 1.0
    driver_tick: float = 0.1
    request_timeout: float = 2.0
    collective_timeout: float = 60.0
    # A replicated service's lease in etcd (whole seconds, etcd's unit): its standby takes over this long after the
    # active replica stopped renewing it (replication/election.py). etcd refreshes every lease when its own leader
    # changes, so losing etcd's leader with the active replica adds an election and an election timeout to it. 1 s
    # keeps a takeover at 2.5-2.7 s median (bench/control_plane_ha.py; 2 s: 3.5 s); an etcd whose election timeout
    # is over 666 ms grants more than asked (1.5 election timeouts at least).
    lease_ttl: int = 1

    def check(self) -> Timing:
        """The rules the intervals keep together, checked when they are read from the environment (every process
        does so at start); ConfigError names the first one broken."""
        for name in ("heartbeat", "discovery_poll", "driver_tick", "request_timeout", "collective_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(_variable(name), f"{getattr(self, name)}", "must be a positive number of seconds")
        for name in ("missed_heartbeats", "lease_ttl"):
            if getattr(self, name) < 1:
                raise ConfigError(_variable(name), f"{getattr(self, name)}", "must be a whole number, at least 1")
        if self.driver_tick > self.heartbeat:
            raise ConfigError(
                _variable("driver_tick"),
                f"{self.driver_tick}",
                f"must not exceed ELASTIC_HEARTBEAT ({self.heartbeat:g} s): the registry acts on what a heartbeat "
                "brings within one",
            )
        if self.collective_timeout <= self.lost_after:
            raise ConfigError(
                _variable("collective_timeout"),
                f"{self.collective_timeout}",
                f"must exceed ELASTIC_HEARTBEAT x ELASTIC_MISSED_HEARTBEATS ({self.lost_after:g} s): a host is found "
                "lost before the others' collectives give up on it",
            )
        return self

    @property
    def lost_after(self) -> float:
        return self.heartbeat * self.missed_heartbeats

    @classmethod
    def from_env(cls) -> Timing:
        """The preset ELASTIC_TIMING names (`local` by default: TIMING_PRESETS), each interval's variable over it."""
        preset_name = os.environ.get("ELASTIC_TIMING") or "local"
        preset = TIMING_PRESETS.get(preset_name)
        if preset is None:
            raise ConfigError("ELASTIC_TIMING", preset_name, f"not a preset (one of: {', '.join(TIMING_PRESETS)})")
        values: dict[str, float | int] = {}
        for f in fields(cls):
            raw = os.environ.get(f"ELASTIC_{f.name.upper()}")
            if raw:
                try:
                    values[f.name] = int(raw) if f.type == "int" else float(raw)
                except ValueError:
                    raise ConfigError(f"ELASTIC_{f.name.upper()}", raw, "not a number") from None
        return replace(preset, **values).check()  # type: ignore[arg-type]

    def as_env(self) -> dict[str, str]:
        return {_variable(f.name): str(getattr(self, f.name)) for f in fields(self)}


# The intervals as a whole, named by ELASTIC_TIMING. `local`: one machine or a LAN with local disks, what the
# defaults above are tuned and measured for (a lost host found in 3 s, a control host's takeover within 3 s).
# `cloud`: VMs whose etcd writes to network disks (fsyncs of tens to hundreds of ms) and whose hosts pause for
# seconds (live migration, a noisy neighbour): a host is lost after 10 s without heartbeats, a replica keeps its
# role through a 5 s stall of etcd, and a request waits 4 s before it is sent again. Slower to react, in exchange for
# no false losses and failovers on a slow day.
TIMING_PRESETS = {
    "local": Timing(),
    "cloud": Timing(
        heartbeat=2.0,
        missed_heartbeats=5,
        discovery_poll=2.0,
        driver_tick=0.2,
        request_timeout=4.0,
        collective_timeout=120.0,
        lease_ttl=5,
    ),
}


def _variable(timing: str) -> str:
    """The environment variable that sets one of Timing's intervals."""
    return f"ELASTIC_{timing.upper()}"


def default_run_dir() -> Path:
    """Where agents put their sockets and services their state by default: ELASTIC_RUN_DIR, else `elastic` in the
    user's own runtime directory (XDG_RUNTIME_DIR, made by the login manager: /run/user/UID), else /tmp/elastic-UID.
    Whoever makes or uses it checks it is the user's own and private (bus/sockets.py's `private_dir`)."""
    if os.environ.get("ELASTIC_RUN_DIR"):
        return Path(os.environ["ELASTIC_RUN_DIR"])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "elastic" if runtime else Path(f"/tmp/elastic-{os.getuid()}")
