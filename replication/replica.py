"""Running a service as one replica of several over etcd (`--store etcd://H:P,H:P,H:P[/PREFIX]`,
replication/store_choice.py).

The process is one replica of its service: it registers as a standby, campaigns for the role
(replication/election.py), and only once elected builds its service: it
reads its state from etcd and binds its sockets (a standby binds nothing,
so clients given every control host reach the active replica only). When
it loses the role it stops at once and starts again as a standby (`exec` of
the same command: nothing it held in memory survives). While active, it keeps
etcd's leader off the active replicas' hosts (replication/leader_placement.py).

The layout under PREFIX: `schema` (STORE_SCHEMA; a newer one is refused),
`leader/<service>` and `replicas/<service>/<replica>` (election.py),
`corrupt/<service>` while a record of the service's cannot be read (the key
and why, for `elasticctl status`; gone once a replica of it starts), and
each service's own keys under `<service>/`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import structlog
from prometheus_client import REGISTRY

from elastic_control_plane.bus import metrics
from elastic_control_plane.bus.service import Service
from elastic_control_plane.replication.election import ElectionTiming, Leadership, Outage
from elastic_control_plane.replication.etcd import EtcdClient, EtcdError, create_revision_is, put_op
from elastic_control_plane.replication.leader_placement import LeaderPlacement
from elastic_control_plane.replication.store_choice import StoreChoice
from elastic_control_plane.replication.store_metrics import REPLICA_ACTIVE, EtcdSizeCollector

STORE_SCHEMA = 1
# How long a service waits for etcd when it starts before it says so and exits.
START_DEADLINE = 10.0
# A replica elected but unable to start its service gives the role up and tries again, as a standby, after this long.
START_RETRY_DELAY = 1.0
# Set in the environment of a replica that stepped down and started again: it waits for etcd rather than exit.
STEPPED_DOWN = "ELASTIC_REPLICA_STEPPED_DOWN"


class StoreUnusable(RuntimeError):
    """The etcd store cannot be used (unreachable, or written by a newer version): the message is one line."""


class CorruptRecord(RuntimeError):
    """A record a service keeps in etcd cannot be read (not the format it writes, or larger than it could be): the
    key and why, in one line. No replica can start the service from it; each says so once and waits for the key to
    change (an operator repairs or deletes it)."""

    def __init__(self, key: bytes, reason: str) -> None:
        super().__init__(f"{key.decode(errors='replace')}: {reason}")
        self.key = key
        self.reason = reason


INFLATED_MAX = 64 * 1024 * 1024  # the largest record a service writes, decompressed, is a few MiB


def inflate(key: bytes, data: bytes, limit: int = INFLATED_MAX) -> bytes:
    """A zlib-compressed record, decompressed to `limit` bytes at most; CorruptRecord when it is not zlib or longer."""
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, limit)
    except zlib.error as exc:
        raise CorruptRecord(key, f"not zlib-compressed: {exc}") from None
    if inflater.unconsumed_tail or not inflater.eof:
        raise CorruptRecord(key, f"truncated, or over {limit} bytes once decompressed")
    return out


def open_etcd(choice: StoreChoice, outage: Outage | None = None, stop: threading.Event | None = None) -> EtcdClient:
    """A client of the store, checked: etcd answers and its schema is one this version reads (written if none).
    Unreachable: `StoreUnusable`, or with `outage` (a replica that stepped down), try again until it answers or
    `stop` is set."""
    client = choice.client()
    key = f"{choice.prefix}/schema".encode()
    while True:
        try:
            found = client.get(key, deadline=START_DEADLINE)  # read first: a full etcd still answers reads
            if found is None:
                client.txn(
                    [create_revision_is(key, 0)], [put_op(key, str(STORE_SCHEMA).encode())], [], deadline=START_DEADLINE
                )
                found = client.get(key, deadline=START_DEADLINE)
            break
        except EtcdError as exc:
            if outage is None or stop is None or stop.is_set():
                client.close()
                raise StoreUnusable(f"etcd at {','.join(choice.endpoints)} cannot be used: {exc}") from None
            outage.failed(exc, client)
    schema = found.value.decode() if found is not None else ""
    if not schema.isdigit() or int(schema) > STORE_SCHEMA:
        client.close()
        raise StoreUnusable(
            f"etcd {choice.prefix}/schema is {schema!r}: written by a newer version (this one reads {STORE_SCHEMA})"
        )
    return client


@dataclass
class Replica:
    """What an elected replica's service is built with: the store's client, the prefix, and its role's fence."""

    client: EtcdClient
    prefix: str
    leadership: Leadership

    def key(self, service: str, name: str) -> bytes:
        return f"{self.prefix}/{service}/{name}".encode()


def serve_replica(
    name: str,
    module: str,
    choice: StoreChoice,
    replica_name: str,
    address: str,
    timing: ElectionTiming,
    build: Callable[[Replica], Service],
    log: structlog.stdlib.BoundLogger,
) -> None:
    """Register, wait for the role, build the service and serve until SIGTERM (resign: a standby takes over at once)
    or until the role is lost or the service cannot start (then `exec` this command again, as a standby)."""
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    outage = Outage(log) if os.environ.get(STEPPED_DOWN) else None  # only the first start gives up on etcd
    client = open_etcd(choice, outage, stopping)
    leadership = Leadership(client, choice.prefix, name, replica_name, address, timing=timing, log=log)
    if outage is not None:
        leadership.outage = outage
    if not leadership.register(stopping):
        return
    REPLICA_ACTIVE.labels(name).set(0)
    log.info("standby", replica=replica_name, store=",".join(choice.endpoints))
    waited = time.monotonic()
    if not leadership.campaign(stopping):
        if stopping.is_set():
            leadership.end("stopped", revoke=True)
            return
        step_down(leadership, module, log)
    REPLICA_ACTIVE.labels(name).set(1)
    log.info("active", replica=replica_name, fence=leadership.revision, waited_s=round(time.monotonic() - waited, 3))
    try:
        service = build(Replica(client, choice.prefix, leadership))
    except CorruptRecord as exc:  # no replica can start from it: say so once, stand by until the key changes
        leadership.end(f"a corrupt record: {exc}", revoke=True)
        log.error("corrupt_record", key=exc.key.decode(errors="replace"), reason=exc.reason)
        _mark_corrupt(client, corrupt_key(choice.prefix, name), exc, replica_name, log)
        if not _wait_for_change(client, exc.key, stopping):
            return
        step_down(leadership, module, log)
    except Exception as exc:  # its state unreadable for now, or its address taken: another replica may do better
        reason = f"{type(exc).__name__}: {exc}"
        leadership.end(f"its service could not start: {reason}", revoke=True)
        log.warning("start_failed", reason=reason)
        if stopping.wait(START_RETRY_DELAY):
            return
        step_down(leadership, module, log)
    service.may_serve = lambda: leadership.held() and not stopping.is_set()
    LeaderPlacement(client, choice.prefix, leadership.held, log).start(stopping)
    _mark_corrupt(client, corrupt_key(choice.prefix, name), None, replica_name, log)
    metrics.watch_service(service)
    REGISTRY.register(EtcdSizeCollector(client))
    try:
        service.run()
    finally:
        service.close()
    if stopping.is_set():
        leadership.end("stopped", revoke=True)
        log.info("stopped", replica=replica_name)
        return
    step_down(leadership, module, log)


def corrupt_key(prefix: str, service: str) -> bytes:
    return f"{prefix}/corrupt/{service}".encode()


def _mark_corrupt(
    client: EtcdClient, key: bytes, found: CorruptRecord | None, replica: str, log: structlog.stdlib.BoundLogger
) -> None:
    """Say in etcd, for `elasticctl status`, which record keeps the service from starting (None: none does now)."""
    try:
        if found is None:
            client.delete(key)
        else:
            record = {"key": found.key.decode(errors="replace"), "reason": found.reason, "replica": replica}
            client.put(key, json.dumps(record).encode())
    except EtcdError as exc:
        log.warning("corrupt_mark_not_written", reason=str(exc))


def _wait_for_change(client: EtcdClient, key: bytes, stopping: threading.Event) -> bool:
    """Wait until `key` changes (True) or the process is asked to stop (False); etcd out of reach: try again."""
    while not stopping.is_set():
        try:
            _, read_at = client.get_at(key)
            for _ in client.watch(key, start_revision=read_at + 1, stop=stopping):
                return True
        except EtcdError:
            stopping.wait(START_RETRY_DELAY)
    return False


def step_down(leadership: Leadership, module: str, log: structlog.stdlib.BoundLogger) -> NoReturn:
    """End the leadership and start this command afresh as a standby: nothing of the lost role stays in memory."""
    leadership.end(leadership.why_not_held() or "the role was lost")
    log.warning("stepped_down", reason=leadership.end_reason)
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[STEPPED_DOWN] = "1"
    os.execv(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]])
