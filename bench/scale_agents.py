"""Simulated agents for the scale benchmark (bench/scale.py): many agents in one process, one event loop.

`python -m bench.scale_agents --proc I --first F --count C --slots S --control ENDPOINT` runs agents
host-F .. host-(F+C-1). Each has its own sockets, so the services see one peer per agent: a DEALER to
discovery, a DEALER to rendezvous and a SUB to the notifier's events. Like agent/agent.py, an agent
registers, heartbeats once a heartbeat interval (one request at a time, `unknown` or `lost`: register
again) and follows the events; its workers are simulated too, with no process behind them:

- on `round`, each slot of the host in the round that has no worker gets one, which waits for a round
  (after_round 0); the rank it is given is checked against `get_host_assignments` of the round,
  computed once per process and round;
- on `hosts_updated` or `abort`, each worker holding a rank in round R waits again with after_round R
  (the registry counts it READY); a worker told `removed` stops;
- the waiting workers of a host enter the round together, in the host's one `enter_round`, as the agent
  does (agent/round_entry.py): a newer entry replaces the parked one, the slots left unanswered by a
  reply go out again, a parked entry without an answer is sent again every JOIN_RESEND seconds.

The loop is an epoll over every socket's fd (and the control socket's) plus a heap of timers; heartbeats
go out in HEARTBEAT_BUCKETS batches a heartbeat interval, so the loop wakes a few times an interval
and not once per agent. An event is decoded once per process, not once per subscriber.

The benchmark drives the process over the control socket (a DEALER to its ROUTER, msgpack maps):
the process says `hello` once its sockets exist; then each `{op, ...}` is answered with the same op:
`state` (counters), `ranks` (workers holding a rank in a round newer than `above`), `arrivals` (each
live agent's first arrival of an event type after a time), `connect` (the agents connect and register: the
benchmark asks once the services listen) and `lose` (an agent goes silent: no more heartbeats, its sockets
closed). The process runs until it is killed.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import os
import random
import resource
import select
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

from elastic_control_plane.bus.config import Endpoints, Timing
from elastic_control_plane.bus.envelope import Message, WireError, decode, encode
from elastic_control_plane.bus.pubsub import HEARTBEAT as NOTIFIER_HEARTBEAT
from elastic_control_plane.bus.roles import AGENT
from elastic_control_plane.bus.sockets import HARD_MAX_MESSAGE_BYTES, HIGH_WATER_MARK, Security
from elastic_control_plane.job.assignments import get_host_assignments

JOIN_RESEND = 5.0  # the agent forwards a worker's parked join with this timeout (agent/agent.py `_forward`)
HEARTBEAT_BUCKETS = 20  # batches of heartbeats an interval: each wake of the loop polls every socket
RESEND_SCAN = 1.0  # how often joins due for a resend are looked for
EVENTS_DECODED_KEPT = 16  # distinct events kept decoded; all subscribers of a process get each within a loop or two
REJOIN_EVENTS = ("hosts_updated", "abort")
MAX_SOCKETS = 65536  # the context's limit (libzmq's default is 1023); three sockets an agent


@functools.cache
def agent_curve_keys() -> tuple[bytes, bytes, bytes] | None:
    """(public, secret, server's public) of the agents' key in ELASTIC_KEYS, or None without keys."""
    keys = os.environ.get("ELASTIC_KEYS")
    if not keys:
        return None
    security = Security(keys_dir=Path(keys), role=AGENT)
    return (*security.client_keypair(), security.server_public_key())


def unconnected_client_socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    """A client socket with the limits and the security (an agent's CURVE key, with ELASTIC_KEYS) of
    bus.sockets.client_socket, connected later: the sockets of thousands of agents are made before the services
    listen, and none of them retries a connection meanwhile."""
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.sndhwm = sock.rcvhwm = HIGH_WATER_MARK
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_MAX_MESSAGE_BYTES)
    curve = agent_curve_keys()
    if curve is not None:
        sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    return sock


def host_name(index: int) -> str:
    return f"host-{index:05d}"


def raise_fd_limit() -> int:
    """Raise the soft limit of open files to the hard limit (children inherit it); return the limit."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


@dataclass
class Worker:
    """A simulated worker of one slot: the last round it held a rank in, and its join in flight (if any)."""

    local_rank: int
    pid: int  # a fake one, unique in the run
    held_round: int = 0
    rank: int | None = None
    rank_checked: bool = False  # against the round's assignment, once the round's event is here
    rank_at: float = 0.0  # wall time the rank arrived
    rank_join_sent_at: float = 0.0  # wall time the join that got it was sent
    waits_after: int | None = None  # the round after which it waits for one, while it waits


class RoundCache:
    """Per process and round: the ranks `get_host_assignments` gives, and each host's slot ids."""

    def __init__(self) -> None:
        self._rounds: dict[int, tuple[dict[tuple[str, int], int], dict[str, list[int]]]] = {}

    def get(self, number: int, hosts: list[list[Any]]) -> tuple[dict[tuple[str, int], int], dict[str, list[int]]]:
        if number not in self._rounds:
            slots = get_host_assignments([(name, ids) for name, ids in hosts], 0)
            ranks = {(s.hostname, s.local_rank): s.rank for s in slots}
            ids_by_host: dict[str, list[int]] = {}
            for s in slots:
                ids_by_host.setdefault(s.hostname, []).append(s.local_rank)
            self._rounds = {n: r for n, r in self._rounds.items() if n >= number - 1}
            self._rounds[number] = (ranks, ids_by_host)
        return self._rounds[number]

    def rank(self, number: int, slot: tuple[str, int]) -> int | None:
        """The rank of `slot` in round `number`, if this process has seen that round's event."""
        kept = self._rounds.get(number)
        return kept[0].get(slot) if kept is not None else None


class EventDecoder:
    """Decodes an event once per process: the same frames reach every subscriber of the process."""

    def __init__(self) -> None:
        self._decoded: OrderedDict[tuple[bytes, int, bytes], tuple[bytes, Message]] = OrderedDict()

    def decode(self, frames: list[bytes]) -> Message | None:
        if len(frames) < 3:
            return None
        header, body = frames[1], frames[2]
        key = (header, len(body), body[-48:])
        kept = self._decoded.get(key)
        if kept is not None and kept[0] == body:
            return kept[1]
        try:
            msg = decode(frames[1:])
        except WireError:
            return None
        self._decoded[key] = (body, msg)
        while len(self._decoded) > EVENTS_DECODED_KEPT:
            self._decoded.popitem(last=False)
        return msg


class SimAgent:
    """One simulated agent: its three sockets, its registration and heartbeat, its workers."""

    def __init__(self, sim: Simulator, host: str, slots: int) -> None:
        self.sim = sim
        self.host = host
        self.slots = slots
        self.incarnation = f"agent:{host}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.discovery = unconnected_client_socket(sim.ctx, zmq.DEALER)
        self.rendezvous = unconnected_client_socket(sim.ctx, zmq.DEALER)
        self.events = unconnected_client_socket(sim.ctx, zmq.SUB)
        self.alive = True
        self.registered = False
        self.subscribed = False
        self.discovery_request: str | None = None
        self.discovery_sent_at = 0.0
        self.discovery_frames: list[bytes] = []
        self.last_seq: int | None = None
        self.workers: dict[int, Worker] = {}
        self.join_id: str | None = None  # the host's join in flight
        self.join_frames: list[bytes] = []
        self.join_sent_at = 0.0
        self.join_resend_at = 0.0  # monotonic
        self.arrivals: dict[
            str, list[tuple[float, float, int]]
        ] = {}  # event type -> (arrived, published, round) of each

    @property
    def sockets(self) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
        return self.discovery, self.rendezvous, self.events

    def connect(self) -> None:
        endpoints = self.sim.endpoints
        for sock, endpoint in zip(self.sockets, (endpoints.discovery, endpoints.rendezvous, endpoints.events)):
            sock.connect(endpoint)

    # -- discovery -------------------------------------------------------------------------------
    def tick(self, now: float) -> None:
        """One heartbeat interval passed: send the request still unanswered again (as the agent does, until the
        host would count as lost), or register or heartbeat."""
        if not self.alive:
            return
        if self.discovery_request is not None and now - self.discovery_sent_at < self.sim.lost_after:
            self.sim.send(self.discovery, self.discovery_frames)
            return
        if self.registered:
            self._ask_discovery("heartbeat", {"host": self.host, "incarnation": self.incarnation, "warm": True}, now)
        else:
            self.register(now)

    def register(self, now: float) -> None:
        body = {
            "host": self.host,
            "slots": self.slots,
            "incarnation": self.incarnation,
            "warm": True,
            "down": [],
            "down_version": 0,
        }
        self._ask_discovery("register", body, now)

    def _ask_discovery(self, msg_type: str, body: dict[str, Any], now: float) -> None:
        self.discovery_request = self.sim.next_id()
        self.discovery_sent_at = now
        self.discovery_frames = encode(
            Message(type=msg_type, body=body, id=self.discovery_request, sender=self.incarnation)
        )
        self.sim.send(self.discovery, self.discovery_frames)

    def on_discovery(self) -> None:
        for reply in self.sim.replies(self.discovery):
            if reply.id != self.discovery_request:
                continue
            self.discovery_request = None
            if reply.error is not None:
                self.sim.errors[f"discovery:{reply.type}:{reply.error}"] += 1
            elif reply.type == "register":
                self.registered = True
            elif reply.body.get("status") == "ok":
                self.sim.heartbeats_ok += 1
            else:
                self.sim.heartbeats_refused[str(reply.body.get("status"))] += 1
                self.registered = False
                self.register(time.monotonic())

    # -- events ----------------------------------------------------------------------------------
    def on_event(self, event: Message, arrived: float) -> None:
        seq = event.body.get("seq")
        if event.type == NOTIFIER_HEARTBEAT:
            self.subscribed = True
            return
        if isinstance(seq, int):
            if self.last_seq is not None and seq > self.last_seq + 1:
                self.sim.events_missed += seq - self.last_seq - 1
            if self.last_seq is not None and seq <= self.last_seq:
                return
            self.last_seq = seq
        self.sim.events_seen[event.type] += 1
        stamp = (arrived, float(event.body.get("time", 0.0)), int(event.body.get("round") or 0))
        self.arrivals.setdefault(event.type, []).append(stamp)
        if event.type == "round":
            self._on_round(event.body)
        elif event.type in REJOIN_EVENTS:
            self._rejoin()

    def _on_round(self, body: dict[str, Any]) -> None:
        number = int(body["round"])
        _, ids_by_host = self.sim.rounds.get(number, body["hosts"])
        started = False
        for local_rank in ids_by_host.get(self.host, []):
            worker = self.workers.get(local_rank)
            if worker is None:
                worker = self.workers[local_rank] = Worker(local_rank, self.sim.next_pid(), waits_after=0)
                started = True
            elif worker.held_round == number:
                self._check_rank(worker)
        if started:
            self._join()

    def _rejoin(self) -> None:
        """Like real workers told the hosts changed (or the round aborted): they wait for the next round."""
        rejoined = False
        for worker in self.workers.values():
            if worker.held_round > 0 and worker.waits_after is None:
                worker.waits_after = worker.held_round
                rejoined = True
        if rejoined:
            self._join()

    # -- rendezvous ------------------------------------------------------------------------------
    def _join(self) -> None:
        """One entry for every waiting worker of the host; it replaces the one in flight."""
        if self.join_id is not None:
            self.sim.pending_joins.pop(self.join_id, None)
        slots = [[w.local_rank, w.waits_after, w.pid] for w in self.workers.values() if w.waits_after is not None]
        self.join_id = self.sim.next_id()
        self.join_frames = encode(
            Message(
                type="enter_round", body={"host": self.host, "slots": slots}, id=self.join_id, sender=self.incarnation
            )
        )
        self.join_sent_at = time.time()
        self.join_resend_at = time.monotonic() + JOIN_RESEND
        self.sim.send(self.rendezvous, self.join_frames)
        self.sim.pending_joins[self.join_id] = self
        self.sim.entries_sent += 1

    def resend_join(self, now: float) -> None:
        if self.join_id is not None and now >= self.join_resend_at:
            self.join_resend_at = now + JOIN_RESEND
            self.sim.send(self.rendezvous, self.join_frames)
            self.sim.entries_resent += 1

    def on_rendezvous(self) -> None:
        arrived = time.time()
        for reply in self.sim.replies(self.rendezvous):
            if self.sim.pending_joins.pop(reply.id, None) is None:
                continue
            self.join_id = None
            if reply.error is not None:
                self.sim.errors[f"rendezvous:enter_round:{reply.error}"] += 1
                continue
            for local_rank, pid, answer in reply.body["answers"]:
                worker = self.workers.get(local_rank)
                if worker is None or worker.pid != pid or worker.waits_after is None:
                    continue
                worker.waits_after = None
                if answer.get("removed"):
                    del self.workers[local_rank]
                    self.sim.workers_removed += 1
                else:
                    self._took_rank(worker, answer, arrived)
            if any(w.waits_after is not None for w in self.workers.values()):
                self._join()

    def _took_rank(self, worker: Worker, answer: dict[str, Any], arrived: float) -> None:
        worker.held_round, worker.rank_at, worker.rank_join_sent_at = int(answer["round"]), arrived, self.join_sent_at
        worker.rank, worker.rank_checked = answer.get("rank"), False
        self._check_rank(worker)

    def _check_rank(self, worker: Worker) -> None:
        """Compare the rank the rendezvous gave with the round's assignment, once this process has the round's
        event (survivors' joins are answered before the registry publishes the round)."""
        expected = self.sim.rounds.rank(worker.held_round, (self.host, worker.local_rank))
        if expected is not None and not worker.rank_checked:
            worker.rank_checked = True
            self.sim.ranks_checked += 1
            self.sim.rank_mismatches += expected != worker.rank

    def lose(self) -> None:
        """Go silent like a hung host: no more heartbeats, sockets closed, workers gone."""
        self.alive = False
        for sock in self.sockets:
            self.sim.forget_socket(sock)
            sock.close(linger=0)
        if self.join_id is not None:
            self.sim.pending_joins.pop(self.join_id, None)
        self.workers.clear()


class Simulator:
    """The agents of one process, their loop, and the control channel to the benchmark."""

    def __init__(self, proc: int, first: int, count: int, slots: int, control: str) -> None:
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        self.endpoints = Endpoints.from_env()
        timing = Timing.from_env()
        self.heartbeat, self.lost_after = timing.heartbeat, timing.lost_after
        self.rounds = RoundCache()
        self.decoder = EventDecoder()
        self._ids = itertools.count(1)
        self._pids = itertools.count(proc * 10_000_000 + 1)
        self.pending_joins: dict[str, SimAgent] = {}  # the agents' joins in flight, by request id
        self.errors: Counter[str] = Counter()
        self.heartbeats_refused: Counter[str] = Counter()
        self.events_seen: Counter[str] = Counter()
        self.heartbeats_ok = self.entries_sent = self.entries_resent = self.workers_removed = 0
        self.events_missed = self.ranks_checked = self.rank_mismatches = self.sends_dropped = 0
        self._epoll = select.epoll()
        self._by_fd: dict[int, zmq.Socket] = {}
        self._touched: set[zmq.Socket] = set()
        self.control = self.ctx.socket(zmq.DEALER)
        self.control.linger = 0
        self.control.connect(control)
        self._handlers: dict[zmq.Socket, Callable[[], None]] = {self.control: self._on_control}
        self._subscribers: dict[zmq.Socket, SimAgent] = {}
        self._watch(self.control)
        self.agents = [self._add_agent(host_name(first + i), slots) for i in range(count)]
        self.by_host = {agent.host: agent for agent in self.agents}
        self._timers: list[tuple[float, int, Callable[[float], None]]] = []
        self._timer_order = itertools.count()
        self.proc = proc

    def _add_agent(self, host: str, slots: int) -> SimAgent:
        agent = SimAgent(self, host, slots)
        self._handlers[agent.discovery] = agent.on_discovery
        self._handlers[agent.rendezvous] = agent.on_rendezvous
        self._subscribers[agent.events] = agent
        for sock in agent.sockets:
            self._watch(sock)
        return agent

    # -- sockets: epoll over their file descriptors ----------------------------------------------
    # A zmq.Poller polls every socket on each call (tens of ms for thousands); epoll costs what is ready. A zmq
    # socket's fd only signals a change, so a socket is read until it has nothing, and one that was written to is
    # looked at again before the loop waits (a send may take the signal of a message that arrived meanwhile).
    def _watch(self, sock: zmq.Socket) -> None:
        fd = sock.getsockopt(zmq.FD)
        self._by_fd[fd] = sock
        self._epoll.register(fd, select.EPOLLIN)

    def forget_socket(self, sock: zmq.Socket) -> None:
        fd = sock.getsockopt(zmq.FD)
        self._epoll.unregister(fd)
        del self._by_fd[fd]
        self._handlers.pop(sock, None)
        self._subscribers.pop(sock, None)
        self._touched.discard(sock)

    def send(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        try:
            sock.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self.sends_dropped += 1
        self._touched.add(sock)

    def _readable(self, timeout: float) -> list[zmq.Socket]:
        signalled = {self._by_fd[fd] for fd, _ in self._epoll.poll(timeout) if fd in self._by_fd}
        candidates, self._touched = signalled | self._touched, set()
        return [sock for sock in candidates if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN]

    def next_id(self) -> str:
        return str(next(self._ids))

    def next_pid(self) -> int:
        return next(self._pids)

    @staticmethod
    def replies(sock: zmq.Socket) -> list[Message]:
        found = []
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return found
            try:
                found.append(decode(frames))
            except WireError:
                continue

    # -- timers ----------------------------------------------------------------------------------
    def at(self, due: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self._timers, (due, next(self._timer_order), fn))

    def _heartbeat_bucket(self, agents: list[SimAgent]) -> Callable[[float], None]:
        def beat(now: float) -> None:
            for agent in agents:
                agent.tick(now)
            self.at(now + self.heartbeat, beat)

        return beat

    def _resend_joins(self, now: float) -> None:
        if self.pending_joins:
            for agent in self.agents:
                agent.resend_join(now)
        self.at(now + RESEND_SCAN, self._resend_joins)

    def _run_due_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            fn(now)

    # -- loop ------------------------------------------------------------------------------------
    def run(self) -> None:
        """Say hello (the sockets exist), then serve until killed; the agents start on `connect`."""
        self._send_control({"op": "hello", "proc": self.proc, "agents": len(self.agents), "pid": os.getpid()})
        while True:
            wait = self._timers[0][0] - time.monotonic() if self._timers else 0.1
            self._handle(self._readable(0.0 if self._touched else max(0.0, min(wait, 0.1))))
            self._run_due_timers()

    def _start_agents(self) -> None:
        """Connect every agent and register it at once; heartbeats follow in batches over each interval."""
        now = time.monotonic()
        shuffled = random.sample(self.agents, len(self.agents))
        for agent in shuffled:
            agent.connect()
        for agent in shuffled:
            agent.register(now)
        for bucket in range(HEARTBEAT_BUCKETS):
            self.at(
                now + self.heartbeat * (1 + bucket / HEARTBEAT_BUCKETS),
                self._heartbeat_bucket(shuffled[bucket::HEARTBEAT_BUCKETS]),
            )
        self.at(now + RESEND_SCAN, self._resend_joins)

    def _handle(self, readable: list[zmq.Socket]) -> None:
        """Events first, each stamped as it is read, then replies and control: an event's arrival time is not
        delayed by the work that earlier events of the same batch cause."""
        events: list[tuple[SimAgent, list[bytes], float]] = []
        others = []
        for sock in readable:
            agent = self._subscribers.get(sock)
            if agent is None:
                others.append(sock)
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                events.append((agent, frames, time.time()))
        for agent, frames, arrived in events:
            event = self.decoder.decode(frames)
            if event is not None and agent.alive:
                agent.on_event(event, arrived)
        for sock in others:
            handler = self._handlers.get(sock)
            if handler is not None:
                handler()

    # -- control ---------------------------------------------------------------------------------
    def _send_control(self, body: dict[str, Any]) -> None:
        self.send(self.control, [msgpack.packb(body, use_bin_type=True)])

    def _on_control(self) -> None:
        while True:
            try:
                request = msgpack.unpackb(self.control.recv(zmq.NOBLOCK), raw=False)
            except zmq.Again:
                return
            answer = getattr(self, f"_op_{request['op']}")(request)
            self._send_control({"op": request["op"], "proc": self.proc, **answer})

    def _op_state(self, request: dict[str, Any]) -> dict[str, Any]:
        live = [a for a in self.agents if a.alive]
        return {
            "registered": sum(a.registered for a in live),
            "subscribed": sum(a.subscribed for a in live),
            "alive": len(live),
            "heartbeats_ok": self.heartbeats_ok,
            "heartbeats_refused": dict(self.heartbeats_refused),
            "entries_sent": self.entries_sent,
            "entries_resent": self.entries_resent,
            "workers_removed": self.workers_removed,
            "events_seen": dict(self.events_seen),
            "events_missed": self.events_missed,
            "ranks_checked": self.ranks_checked,
            "rank_mismatches": self.rank_mismatches,
            "sends_dropped": self.sends_dropped,
            "errors": dict(self.errors),
        }

    def _op_ranks(self, request: dict[str, Any]) -> dict[str, Any]:
        """Live workers holding a rank in a round newer than `above`: how many, the newest round, when the last
        rank arrived and when the last of their joins was sent."""
        above = request["above"]
        holding = [w for a in self.agents if a.alive for w in a.workers.values() if w.held_round > above]
        return {
            "join_errors": {code: n for code, n in self.errors.items() if code.startswith("rendezvous:enter_round:")},
            "count": len(holding),
            "round": max((w.held_round for w in holding), default=0),
            "last_rank_at": max((w.rank_at for w in holding), default=0.0),
            "first_rank_at": min((w.rank_at for w in holding), default=0.0),
            "last_join_sent_at": max((w.rank_join_sent_at for w in holding), default=0.0),
        }

    def _op_arrivals(self, request: dict[str, Any]) -> dict[str, Any]:
        """Each live agent's first arrival of event type `event` after wall time `after` (and of a round after
        `above`, for events that name one), as [arrived, published]."""
        event, after, above = request["event"], request["after"], request.get("above", -1)
        times = []
        for agent in self.agents:
            if agent.alive:
                first = next(
                    (stamp[:2] for stamp in agent.arrivals.get(event, []) if stamp[0] > after and stamp[2] > above),
                    None,
                )
                if first is not None:
                    times.append(first)
        return {"times": times, "alive": sum(a.alive for a in self.agents)}

    def _op_connect(self, request: dict[str, Any]) -> dict[str, Any]:
        self._start_agents()
        return {}

    def _op_lose(self, request: dict[str, Any]) -> dict[str, Any]:
        self.by_host[request["host"]].lose()
        return {}

    def close(self) -> None:
        for agent in self.agents:
            if agent.alive:
                for sock in agent.sockets:
                    sock.close(linger=0)
        self.control.close(linger=0)
        self._epoll.close()
        self.ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Simulated agents of bench/scale.py (endpoints and heartbeat from ELASTIC_*)."
    )
    parser.add_argument("--proc", type=int, required=True, help="This simulator's number.")
    parser.add_argument("--first", type=int, required=True, help="Number of the first host (host-NNNNN).")
    parser.add_argument("--count", type=int, required=True, help="How many agents.")
    parser.add_argument("--slots", type=int, required=True, help="Slots per agent.")
    parser.add_argument("--control", required=True, help="The benchmark's control endpoint (a ROUTER).")
    args = parser.parse_args()
    raise_fd_limit()
    simulator = Simulator(args.proc, args.first, args.count, args.slots, args.control)
    try:
        simulator.run()
    finally:
        simulator.close()


if __name__ == "__main__":
    main()
