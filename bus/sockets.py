"""Every zmq socket of the project is made here: limits, timeouts and security are set once.

A socket gets LINGER 0 (closing never blocks), bounded high-water marks, a hard
maximum inbound frame size (a peer sending more is disconnected by libzmq;
smaller oversized messages are refused politely by `envelope.decode`), and, when
keys are configured, CURVE: servers require an authorised client key (checked by
a ZAP authenticator, Ironhouse pattern), clients present their role's
(bus/roles.py).

A client socket connects to every endpoint of an endpoint list (bus/config.py): a service replicated over the
control hosts is bound by its active replica only. A DEALER given several endpoints queues a message only to a
connection whose handshake has completed (IMMEDIATE), that is to the bound replica: with none, a send finds no room
(`zmq.Again`, or POLLOUT not ready) and the client waits or tries again. It also checks its connections with ZMTP
heartbeats, so that one to a replica that stopped answering (a paused ex-active) is closed within
LIST_HEARTBEAT_TIMEOUT_MS instead of taking its turn of the messages; a reconnection to it never completes while it is
paused. A SUB gets every endpoint's messages; only the active replica publishes.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from elastic_control_plane.bus.config import endpoint_list, is_loopback
from elastic_control_plane.bus.envelope import MAX_MESSAGE_BYTES
from elastic_control_plane.bus.roles import AGENT, AGENTS_DIR, AUTHORIZED_DIR, KEY_OF_ROLE, OPERATOR, check_host_name

# A client may queue this many requests: an agent relays those of all its workers.
HIGH_WATER_MARK = 10_000
# A server queues at most this many messages per peer each way, so that junk from one peer holds at most this many
# frames in libzmq's queues: a peer that sends faster waits in TCP (nothing is lost), and a reply to a peer that
# reads none of its last 100 is dropped (its client resends and gets the cached reply). Legitimate peers have a
# handful of requests in flight.
SERVER_HIGH_WATER_MARK = 100
# Frames up to this size are read and, when over MAX_MESSAGE_BYTES, refused politely by `envelope.decode`; a larger
# frame is not read at all: libzmq drops its peer.
HARD_MAX_MESSAGE_BYTES = MAX_MESSAGE_BYTES + 1024 * 1024
SERVER_KEY = "server"
SHARES_DIR = "shares"  # each role's share of a keys directory, where `elasticctl keys generate --shares` writes them
# A client socket with several endpoints pings each connection this often, and closes one that sent nothing for
# LIST_HEARTBEAT_TIMEOUT_MS after a ping (libzmq then connects again).
LIST_HEARTBEAT_IVL_MS = 500
LIST_HEARTBEAT_TIMEOUT_MS = 1500


class SecurityError(RuntimeError):
    """Keys are missing or unusable, or an insecure bind was not allowed."""


@dataclass(frozen=True)
class Security:
    """Where the CURVE keys live (None: no encryption), whether a non-loopback bind without keys is allowed, and the
    role whose key this process presents as a client (bus/roles.py)."""

    keys_dir: Path | None = None
    insecure: bool = False
    role: str = OPERATOR
    host: str | None = None  # an agent's host: its own key, where the directory holds one per host

    def check_bind(self, endpoint: str) -> None:
        if self.keys_dir is not None or self.insecure or not endpoint.startswith("tcp://"):
            return
        host = endpoint[len("tcp://") :].rsplit(":", 1)[0]
        if not is_loopback(host):
            raise SecurityError(
                f"refusing to bind {endpoint} without CURVE keys: pass --keys DIR (elasticctl keys generate DIR) "
                "or --insecure"
            )

    def check_connect(self, endpoints: str) -> None:
        """A client without keys talks in plaintext and authenticates no server: only to loopback, unless
        `insecure` (whoever answered at an address elsewhere, or bound it first while the control plane restarted,
        would serve the job)."""
        if self.keys_dir is not None or self.insecure:
            return
        for endpoint in endpoint_list(endpoints):
            host = endpoint[len("tcp://") :].rsplit(":", 1)[0] if endpoint.startswith("tcp://") else "localhost"
            if not is_loopback(host):
                raise SecurityError(
                    f"refusing to connect to {endpoint} without CURVE keys (nothing would authenticate the server): "
                    "pass --keys DIR (elasticctl keys generate DIR) or --insecure"
                )

    def keypair(self, name: str) -> tuple[bytes, bytes]:
        assert self.keys_dir is not None
        secret_file = self.keys_dir / f"{name}.key_secret"
        try:
            return zmq.auth.load_certificate(secret_file)  # type: ignore[return-value]
        except (OSError, ValueError) as exc:
            raise SecurityError(f"cannot load key {secret_file}: {exc}") from None

    def client_keypair(self) -> tuple[bytes, bytes]:
        """This role's keypair (an agent's host's own where the directory holds one per host); the operator's in a
        keys directory made before roles."""
        assert self.keys_dir is not None
        hosts = self.keys_dir / AGENTS_DIR
        if self.role == AGENT and self.host is not None and (hosts / f"{self.host}.key_secret").exists():
            return self.keypair(f"{AGENTS_DIR}/{self.host}")
        name = KEY_OF_ROLE[self.role]
        if self.role == AGENT and hosts.is_dir() and not (self.keys_dir / f"{name}.key_secret").exists():
            raise SecurityError(
                f"{hosts} holds no key for host {self.host!r}: elasticctl keys generate DIR --agent-host {self.host}"
            )
        if not (self.keys_dir / f"{name}.key_secret").exists():
            name = KEY_OF_ROLE[OPERATOR]
        return self.keypair(name)

    def server_public_key(self) -> bytes:
        assert self.keys_dir is not None
        public, _ = zmq.auth.load_certificate(self.keys_dir / f"{SERVER_KEY}.key")
        return public


def generate_keys(keys_dir: Path, agent_hosts: Sequence[str] = ()) -> None:
    """Write the server's keypair and one client keypair per role (secret files 0600 from creation), and authorise
    each role's. With `agent_hosts`, the agents get one keypair per host (`agents/HOST.key`) and no shared one."""
    hosts = [check_host_name(host) for host in agent_hosts]
    keys_dir.mkdir(parents=True, exist_ok=True)
    authorized = keys_dir / AUTHORIZED_DIR
    # The per-host keys an earlier run wrote go; keys an operator added to authorized/ by hand stay.
    shutil.rmtree(authorized / AGENTS_DIR, ignore_errors=True)
    shutil.rmtree(keys_dir / AGENTS_DIR, ignore_errors=True)
    roles = [name for role, name in KEY_OF_ROLE.items() if not (hosts and role == AGENT)]
    names = [SERVER_KEY, *roles, *(f"{AGENTS_DIR}/{host}" for host in hosts)]
    old_umask = os.umask(0o077)
    try:
        (authorized / AGENTS_DIR if hosts else authorized).mkdir(parents=True, exist_ok=True)
        if hosts:
            (keys_dir / AGENTS_DIR).mkdir()
        for name in (SERVER_KEY, *KEY_OF_ROLE.values()):
            (authorized / f"{name}.key").unlink(missing_ok=True)
            for suffix in (".key", ".key_secret"):
                (keys_dir / f"{name}{suffix}").unlink(missing_ok=True)
        for name in names:
            folder, _, base = name.rpartition("/")
            zmq.auth.create_certificates(str(keys_dir / folder), base)
    finally:
        os.umask(old_umask)
    for name in names:
        os.chmod(keys_dir / f"{name}.key_secret", stat.S_IRUSR | stat.S_IWUSR)
    for name in names[1:]:
        (authorized / f"{name}.key").write_bytes((keys_dir / f"{name}.key").read_bytes())


def role_keys(keys_dir: Path, role: str, target: Path) -> Path:
    """`target`, made (0700) to hold what a process of `role` needs of `keys_dir` and nothing more: the server's
    public key and the role's keypair (an agent never holds the server's secret, the operator's keypair or etcd's
    CA). Written afresh each time; the secret 0600 from creation."""
    name = KEY_OF_ROLE[role]
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(target, 0o700)
    for file in (f"{SERVER_KEY}.key", f"{name}.key", f"{name}.key_secret"):
        data = (keys_dir / file).read_bytes()
        partial = target / f".{file}.partial"
        partial.unlink(missing_ok=True)
        with os.fdopen(os.open(partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600), "wb") as out:
            out.write(data)
        os.replace(partial, target / file)
    return target


class _RefusalLog(logging.Logger):
    """zmq.auth reports refusals at debug level; we want each one as a structured warning."""

    def __init__(self) -> None:
        super().__init__("zmq.auth")

    def debug(self, msg: object, *args: object, **kwargs: object) -> None:
        text = str(msg) % args if args else str(msg)
        if text.startswith("DENIED"):
            structlog.get_logger().warning("client_refused", detail=text)


_authenticators: dict[int, ThreadAuthenticator] = {}


def _start_authenticator(ctx: zmq.Context, security: Security) -> None:
    if id(ctx) in _authenticators:
        return
    assert security.keys_dir is not None
    auth = ThreadAuthenticator(ctx, log=_RefusalLog())
    auth.start()
    authorized = security.keys_dir / AUTHORIZED_DIR
    auth.configure_curve(domain="*", location=str(authorized))
    if (authorized / AGENTS_DIR).is_dir():  # each host's own agent key (bus/roles.py)
        auth.certs["*"].update(zmq.auth.load_certificates(str(authorized / AGENTS_DIR)))
    _authenticators[id(ctx)] = auth


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the ZAP authenticator of `ctx`, if any; must happen before the context is terminated."""
    auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()


def _limits(sock: zmq.Socket) -> None:
    sock.linger = 0
    sock.sndhwm = HIGH_WATER_MARK
    sock.rcvhwm = HIGH_WATER_MARK
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)


def server_socket(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    security: Security = Security(),
    options: Mapping[int, int] | None = None,
) -> zmq.Socket:
    """A bound socket (ROUTER, XPUB) with server limits and `options` set before binding; CURVE server if keys are
    configured and the endpoint is TCP."""
    security.check_bind(endpoint)
    sock = ctx.socket(kind)
    _limits(sock)
    sock.sndhwm = SERVER_HIGH_WATER_MARK
    sock.rcvhwm = SERVER_HIGH_WATER_MARK
    for option, value in (options or {}).items():
        sock.setsockopt(option, value)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if security.keys_dir is not None and endpoint.startswith("tcp://"):
        _start_authenticator(ctx, security)
        public, secret = security.keypair(SERVER_KEY)
        sock.curve_server = True
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    if endpoint.startswith("ipc://"):
        _bind_ipc_owner_only(sock, endpoint)
    else:
        sock.bind(endpoint)
    return sock


def private_dir(path: Path, setting: str) -> Path:
    """`path`, made 0700 (with its parents) when missing; SecurityError, one line naming `setting`, when it is not a
    directory of this user's or others may enter it: someone else may have made it, to read or replace what goes in
    (sockets any peer could then reach, the registry's state)."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise SecurityError(f"cannot make the directory {path} ({setting}): {exc.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise SecurityError(f"{path} ({setting}) is not a directory (a symlink?): remove it, or set {setting}")
    if info.st_uid != os.getuid():
        raise SecurityError(
            f"{path} ({setting}) belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): someone else made it; "
            f"remove it, or set {setting} to a directory of yours"
        )
    if info.st_mode & 0o077:
        raise SecurityError(
            f"{path} ({setting}) is open to others (mode {stat.S_IMODE(info.st_mode):o}): chmod 700 it, or set "
            f"{setting} to a directory of yours"
        )
    return path


def _bind_ipc_owner_only(sock: zmq.Socket, endpoint: str) -> None:
    path = Path(endpoint[len("ipc://") :])
    private_dir(path.parent, "ELASTIC_RUN_DIR")
    old_umask = os.umask(0o077)
    try:
        sock.bind(endpoint)
    finally:
        os.umask(old_umask)


def client_socket(ctx: zmq.Context, kind: int, endpoints: str, security: Security = Security()) -> zmq.Socket:
    """A socket (DEALER, SUB) connected to every endpoint of the endpoint list `endpoints`; CURVE client if keys are
    configured and an endpoint is TCP. With several endpoints, a DEALER sends to completed connections only."""
    addresses = endpoint_list(endpoints)
    sock = ctx.socket(kind)
    _limits(sock)
    if security.keys_dir is not None and any(address.startswith("tcp://") for address in addresses):
        public, secret = security.client_keypair()
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = security.server_public_key()
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    if len(addresses) > 1:
        sock.setsockopt(zmq.HEARTBEAT_IVL, LIST_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, LIST_HEARTBEAT_TIMEOUT_MS)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.IMMEDIATE, 1)
    for address in addresses:
        sock.connect(address)
    return sock
