"""A worker's channels to its agent over ipc (libworker's, and a torchrun-mode slot's supervisor,
slot_processes/torchrun_slot.py): requests (any thread, one at a time), events (a daemon thread), and one-way notices
(`notify`, from the training thread; nothing waits for their replies).

The event thread subscribes once (the agent refuses a process that is not one of its workers or standbys, nor runs
under one: that process then hears no events and no heartbeat), then hands each event to the listener callbacks. It
also watches the agent's heartbeat: a worker dies with its agent (PR_SET_PDEATHSIG), but an agent that hangs forever
cannot stop its workers, so a worker whose agent stays silent for `orphan_after` seconds exits. Silence is judged on
a fresh look at the socket: a poll's answer may be stale by the time the thread holds the GIL again (the main thread
kept it in a native call, as long as a hung rank is under judgement), and what arrived meanwhile is waiting.
Before that, a silence of a few heartbeats (at least `WARN_AFTER_MIN` seconds) gets a line on stderr naming the
agent's endpoint (then one a minute), and the first word from the agent after it a line saying so. `link_to_agent`
is the link of a process its agent started, from the environment the agent gave it.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from elastic_control_plane.bus.client import Client, incarnation_id
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.bus.envelope import Message, WireError, decode, encode
from elastic_control_plane.bus.reachability import Reachability
from elastic_control_plane.bus.sockets import client_socket

Listener = Callable[[Message], None]
ORPHAN_EXIT_CODE = 70
WARN_AFTER_MIN = 3.0
ANCESTORS_SEARCHED = 16
ORPHAN_AFTER_MIN, ORPHAN_AFTER_HEARTBEATS = 30.0, 20


def _parent_of(pid: int) -> int:
    """The parent pid of `pid` (0 if it cannot be read): 4th field of /proc/PID/stat (after the command)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def lineage(pid: int) -> Iterator[int]:
    """`pid`, then its ancestors nearest first, up to ANCESTORS_SEARCHED of them (init not included)."""
    yield pid
    for _ in range(ANCESTORS_SEARCHED):
        pid = _parent_of(pid)
        if pid <= 1:
            return
        yield pid


def worker_pid() -> int:
    """This worker's pid as its agent knows it: the process the agent started, which is this one unless the user's
    command wraps the script in something that does not exec (`sh -c "cd src && python train.py"`); then it is the
    ancestor whose parent is the agent. The agent reports exits by that pid, and the registry matches them to the
    worker that joined the round by it."""
    agent = os.environ.get(WorkerEnv.AGENT_PID, "")
    if agent.isdigit():
        for process, parent in itertools.pairwise(lineage(os.getpid())):
            if parent == int(agent):
                return process
    return os.getpid()


def link_to_agent(timing: Timing) -> AgentLink:
    """The link of a process its agent started (the agent's endpoint, the host and the slot's local rank are in its
    environment); an agent silent for ORPHAN_AFTER_HEARTBEATS heartbeats, at least ORPHAN_AFTER_MIN seconds, orphans
    it."""
    orphan_after = max(ORPHAN_AFTER_MIN, ORPHAN_AFTER_HEARTBEATS * timing.heartbeat)
    return AgentLink(
        os.environ[WorkerEnv.AGENT],
        os.environ.get(WorkerEnv.HOST, "?"),
        int(os.environ.get(WorkerEnv.LOCAL_RANK, "-1")),
        orphan_after,
    )


class AgentLink:
    def __init__(self, endpoint: str, host: str, local_rank: int, orphan_after: float) -> None:
        self.endpoint = endpoint
        self.sender = incarnation_id("worker", f"{host}/{local_rank}")
        self.local_rank = local_rank
        self.ctx = zmq.Context()
        self.requests = Client(endpoint, self.sender, ctx=self.ctx, timeout=5.0, deadline=60.0)
        self.listeners: list[Listener] = []
        self.agent = Reachability(max(WARN_AFTER_MIN, Timing.from_env().lost_after), time.monotonic())
        self.orphan_after = orphan_after
        self._subscribed = threading.Event()
        self._notices: zmq.Socket | None = None
        self._thread = threading.Thread(target=self._events_loop, name="libworker-events", daemon=True)
        self._thread.start()

    def wait_subscribed(self, timeout: float) -> bool:
        return self._subscribed.wait(timeout)

    def notify(self, msg_type: str, body: dict[str, Any]) -> None:
        """Send the agent a message and go on: never blocks (with the agent gone, a full queue drops it), and the
        agent's replies are dropped unread before the next one. One thread only calls it: zmq sockets are not
        thread-safe."""
        if self._notices is None:
            self._notices = client_socket(self.ctx, zmq.DEALER, self.endpoint)
        try:
            while True:
                self._notices.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass
        try:
            self._notices.send_multipart(
                encode(Message(type=msg_type, body=body, sender=self.sender + ":notices")), zmq.NOBLOCK
            )
        except zmq.Again:
            pass

    def _events_loop(self) -> None:
        sock = client_socket(self.ctx, zmq.DEALER, self.endpoint)
        subscribe = encode(
            Message(
                type="subscribe",
                body={"pid": worker_pid(), "local_rank": self.local_rank},
                id="subscribe",
                sender=self.sender + ":events",
            )
        )
        sock.send_multipart(subscribe)
        resend_at = time.monotonic() + 1.0
        while True:
            if not self._subscribed.is_set() and time.monotonic() > resend_at:
                sock.send_multipart(subscribe)
                resend_at = time.monotonic() + 1.0
            if not sock.poll(200) and not sock.poll(0):
                self._agent_silent()
                continue
            try:
                msg = decode(sock.recv_multipart())
            except (WireError, zmq.ZMQError):
                continue
            self._agent_heard()
            if msg.reply:
                if msg.error and not self._subscribed.is_set():
                    why = msg.body.get("message", msg.error)
                    say(f"the agent at {self.endpoint} refused this process's events: {why}")
                self._subscribed.set()
                continue
            for listener in list(self.listeners):
                listener(msg)

    def _agent_silent(self) -> None:
        now = time.monotonic()
        silent = self.agent.silent_for(now)
        if silent > self.orphan_after:
            say(f"agent at {self.endpoint} silent for {silent:.0f}s; this worker exits")
            os._exit(ORPHAN_EXIT_CODE)
        if self.agent.missed(now):
            say(
                f"no word from the agent at {self.endpoint} for {silent:.0f}s; still trying (this worker exits "
                f"after {self.orphan_after:.0f}s of silence)"
            )

    def _agent_heard(self) -> None:
        silent = self.agent.reached(time.monotonic())
        if silent is not None:
            say(f"the agent at {self.endpoint} answers again after {silent:.0f}s of silence")


def say(line: str) -> None:
    sys.stderr.write(f"libworker: {line}\n")
    sys.stderr.flush()
