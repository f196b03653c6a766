"""How a member of the chart's etcd starts: `python -m elastic_control_plane.replication.etcd_join CONFIG --others
HOST:PORT,... -- FLAGS...` (the pod's init container) writes etcd's config file CONFIG from the member's flags,
deciding the one thing a static manifest cannot: whether the member bootstraps with the others, or rejoins.

- Its data directory holds a member (`member/`): it starts on its data, as before.
- Its data directory is empty, and the others (their client addresses, `--others`) answer with a cluster that lists this
  member as one that has run (a name, client URLs): its volume was lost. It is removed from the cluster and added
  back as a new member, and starts with `initial-cluster-state: existing` and the cluster's members as its
  `initial-cluster`, catching up from the others. Without this, a member whose volume is lost crash-loops.
- Otherwise (the first start of all three, or the others out of reach): `initial-cluster-state: new`, as given.

The flags are etcd's own (`--name=...`, `--client-cert-auth`), as docker-compose.replicated.yml gives them; the
config file is what etcd reads with `--config-file` (which then ignores every other flag), JSON being YAML: the
TLS flags go in its `client-transport-security` and `peer-transport-security`, a duration as nanoseconds. With TLS
the member speaks to the others with its own certificate (it is valid for clients too).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from elastic_control_plane.replication.etcd import EtcdClient, EtcdError
from elastic_control_plane.replication.etcd_tls import EtcdTls

ASK_WITHIN_S = 5.0  # the others' answer, at a member's start (a pod that guessed wrong restarts and asks again)
INTEGERS = ("heartbeat-interval", "election-timeout", "quota-backend-bytes", "max-request-bytes")
DURATIONS = ("experimental-watch-progress-notify-interval",)
TLS_KEYS = {  # flag -> (section, key)
    "cert-file": ("client-transport-security", "cert-file"),
    "key-file": ("client-transport-security", "key-file"),
    "client-cert-auth": ("client-transport-security", "client-cert-auth"),
    "trusted-ca-file": ("client-transport-security", "trusted-ca-file"),
    "peer-cert-file": ("peer-transport-security", "cert-file"),
    "peer-key-file": ("peer-transport-security", "key-file"),
    "peer-client-cert-auth": ("peer-transport-security", "client-cert-auth"),
    "peer-trusted-ca-file": ("peer-transport-security", "trusted-ca-file"),
}
UNITS_NS = {"ms": 10**6, "s": 10**9, "m": 60 * 10**9, "h": 3600 * 10**9}


def parse_flags(flags: list[str]) -> dict[str, str | bool]:
    """`--key=value` and `--flag` (true), as etcd reads them; ValueError for anything else."""
    parsed: dict[str, str | bool] = {}
    for flag in flags:
        if not flag.startswith("--"):
            raise ValueError(f"{flag!r} is not an etcd flag (--key=value or --flag)")
        key, equals, value = flag[2:].partition("=")
        parsed[key] = value if equals else True
    return parsed


def nanoseconds(duration: str) -> int:
    found = re.fullmatch(r"(\d+)(ms|s|m|h)", duration)
    if found is None:
        raise ValueError(f"{duration!r} is not a duration (e.g. 1s, 500ms)")
    return int(found.group(1)) * UNITS_NS[found.group(2)]


def config_of(flags: dict[str, str | bool]) -> dict[str, Any]:
    """etcd's config file for these flags."""
    config: dict[str, Any] = {"enable-grpc-gateway": True}  # a flag's default that a config file does not get
    for key, value in flags.items():
        if key in TLS_KEYS:
            section, name = TLS_KEYS[key]
            config.setdefault(section, {})[name] = value
        elif key in INTEGERS:
            config[key] = int(value)
        elif key in DURATIONS:
            config[key] = nanoseconds(str(value))
        else:
            config[key] = value
    return config


def rejoin(flags: dict[str, str | bool], client: EtcdClient) -> dict[str, str] | None:
    """If the running cluster lists this member as one that has run, remove it and add it back: the flags it then
    starts with (`initial-cluster` of the cluster's members, state existing); None to bootstrap as given. EtcdError
    when the others do not answer."""
    name, peer_url = str(flags["name"]), str(flags["initial-advertise-peer-urls"])
    members = client.members(deadline=ASK_WITHIN_S)
    mine = [m for m in members if m.name == name or peer_url in m.peer_urls]
    if not mine or not any(m.name and m.client_urls for m in mine):
        return None  # never started: it bootstraps with the others as planned
    for member in mine:
        client.member_remove(member.id, deadline=ASK_WITHIN_S)
    client.member_add([peer_url], deadline=ASK_WITHIN_S)
    cluster = [f"{m.name}={m.peer_urls[0]}" for m in members if m not in mine and m.name and m.peer_urls]
    return {"initial-cluster": ",".join([*cluster, f"{name}={peer_url}"]), "initial-cluster-state": "existing"}


def start_flags(flags: dict[str, str | bool], others: list[str], say: Any = print) -> dict[str, str | bool]:
    """The flags this member starts with, after looking at its data and at the others (see the module's doc)."""
    if (Path(str(flags["data-dir"])) / "member").is_dir():
        return flags
    tls = None
    if isinstance(flags.get("peer-trusted-ca-file"), str):
        tls = EtcdTls(Path(str(flags["peer-cert-file"])).parent).client_context(certificate="server")
    client = EtcdClient(others, tls=tls, deadline=ASK_WITHIN_S)
    try:
        rejoined = rejoin(flags, client)
    except EtcdError as exc:
        say(f"etcd_join: the others did not answer ({exc}): bootstrapping with them")
        return flags
    finally:
        client.close()
    if rejoined is None:
        return flags
    say(f"etcd_join: {flags['name']} lost its data: removed and added back, it joins the running cluster")
    return {**flags, **rejoined}


def main(argv: list[str]) -> int:
    try:
        split = argv.index("--")
        config_path, options, etcd_flags = argv[0], argv[1:split], argv[split + 1 :]
        if options[:1] != ["--others"] or len(options) != 2:
            raise ValueError("expected --others HOST:PORT,HOST:PORT,...")
        flags = parse_flags(etcd_flags)
        for required in ("name", "data-dir", "initial-advertise-peer-urls"):
            if required not in flags:
                raise ValueError(f"--{required} is missing")
    except (ValueError, IndexError) as exc:
        print(f"etcd_join: {exc}; usage: etcd_join CONFIG --others HOST:PORT,... -- FLAGS...", file=sys.stderr)
        return 2
    try:
        chosen = start_flags(flags, options[1].split(","))
        config = config_of(chosen)
    except ValueError as exc:
        print(f"etcd_join: {exc}", file=sys.stderr)
        return 2
    Path(config_path).write_text(json.dumps(config, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
