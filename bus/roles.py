"""Who calls the control plane: one CURVE identity per role, and each handler's allowed roles.

`elasticctl keys generate DIR` writes one client keypair per role, and
authorises each under `DIR/authorized/<key>.key`:
- `service` (`service.key`): the control plane's services calling each other
  (the registry publishing, configuring discovery, starting rounds);
- `agent` (`agent.key`): the agents (register, heartbeats, rounds, exit
  reports); the workers reach the control plane only through their agent.
  With `--agent-host NAME` (repeated), each host gets a key of its own
  instead (`agents/NAME.key`, authorised as `authorized/agents/NAME.key`):
  a request made with it that names a host (`host` in its body) must name
  that one, else `forbidden`: one host's key cannot register, heartbeat,
  drain, report or set a round's store address for another;
- `operator` (`client.key`): `elasticctl` (submit, cancel, drain, status).

A service maps the key a caller authenticated with (its ZAP User-Id: the key,
z85) to the role whose authorised key it is (`CallerRoles`), and a handler
marked `@handles(type, roles=...)` answers only those roles; anyone else gets
`forbidden` and the service logs one line naming the role and the handler.
The checks fail closed: an authorised key of no role (one added to
`authorized/` by hand), or a role whose key is missing from the directory,
gets only the handlers open to every role. The one exception is a keys
directory made before roles, whose only role key is the operator's: that key
is every role, as it was, and the service says so at start. Without keys
(loopback, `--insecure`) and on the agents' owner-only ipc sockets nobody is
checked.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

import zmq.auth

SERVICE, AGENT, OPERATOR = "service", "agent", "operator"
KEY_OF_ROLE = {SERVICE: "service", AGENT: "agent", OPERATOR: "client"}  # the operator's is the first release's key
ANY_ROLE: frozenset[str] = frozenset(KEY_OF_ROLE)
AUTHORIZED_DIR = "authorized"
AGENTS_DIR = "agents"  # one keypair per host, named after it
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def check_host_name(host: str) -> str:
    """A host name that can name a key file: letters, digits, '.', '_' and '-', not starting with a dot."""
    if not HOST_NAME.fullmatch(host):
        raise ValueError(f"host name {host!r} cannot name a key: use letters, digits, '.', '_' and '-'")
    return host


class CallerRoles:
    """The role of each authorised key of a keys directory, and the host a per-host agent key speaks for;
    `single_key` for a directory made before roles."""

    def __init__(self, keys_dir: Path | None) -> None:
        self.by_key: dict[str, str] = {}
        self.host_by_key: dict[str, str] = {}
        if keys_dir is None:
            return
        for role, name in KEY_OF_ROLE.items():
            public = keys_dir / AUTHORIZED_DIR / f"{name}.key"
            if public.is_file():
                self.by_key[_public_key(public)] = role
        hosts = keys_dir / AUTHORIZED_DIR / AGENTS_DIR
        for public in sorted(hosts.glob("*.key")) if hosts.is_dir() else ():
            key = _public_key(public)
            self.by_key[key], self.host_by_key[key] = AGENT, public.stem

    @property
    def single_key(self) -> bool:
        """A keys directory made before roles: the operator's is the only role key authorised, and it is every role."""
        return set(self.by_key.values()) == {OPERATOR}

    def role_of(self, user_id: str | None) -> str | None:
        return None if user_id is None else self.by_key.get(user_id)

    def host_of(self, user_id: str | None) -> str | None:
        """The one host a caller's key may speak for (None: not a per-host key)."""
        return None if user_id is None else self.host_by_key.get(user_id)

    def allows(self, user_id: str | None, roles: Collection[str]) -> bool:
        """May the caller that authenticated as `user_id` (None: not over CURVE) call a handler open to `roles`?"""
        if user_id is None or roles is ANY_ROLE:
            return True
        role = self.role_of(user_id)
        return role is not None and (self.single_key or role in roles)


def _public_key(path: Path) -> str:
    key, _ = zmq.auth.load_certificate(path)
    return key.decode()
