"""A worker's watch on its agent's silence (slot_processes/agent_link.py), against a peer that speaks the agent's side
of the link over ipc: it answers the subscription, then sends heartbeats, or none.

The innocent case: the worker's main thread holds the GIL in a native call for longer than the orphan window while
the agent goes on beating; the event thread's last poll, answered before the call and read after it, said nothing
came. It must not exit as an orphan (found by test_hangs' native hang in CI: the hung rank exited with code 70 at
its first stack dump instead of being judged). The guilty case beside it: an agent that answers and then says
nothing more is left, with exit code 70, once the window has passed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from elastic_control_plane.bus.envelope import Message, decode, encode, reply_to
from elastic_control_plane.slot_processes.agent_link import ORPHAN_EXIT_CODE
from testing.harness import REPO

ORPHAN_AFTER = 2.0
GIL_HELD_S = 4  # libc sleep(3) takes whole seconds
HEARTBEAT = 0.1
QUIET_AFTER_HOLDING = 0.5  # longer than the event thread's poll (0.2 s): its answer, nothing, is read after the call

WORKER = f"""
import ctypes, sys, time
from elastic_control_plane.slot_processes.agent_link import AgentLink
link = AgentLink(sys.argv[1], "host-1", 0, {ORPHAN_AFTER})
assert link.wait_subscribed(10.0), "not subscribed"
print("holding", flush=True)
if sys.argv[2] == "native":
    ctypes.PyDLL(None).sleep({GIL_HELD_S})  # the GIL stays held: no other thread of this process runs
else:
    time.sleep(30)
print("alive", flush=True)
"""


class AgentSide:
    """Answers one subscription; from `beat_from` on (None: never), a heartbeat every HEARTBEAT seconds."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        self.sock.bind(endpoint)
        self.beat_from: float | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        route = None
        while not self.stop.is_set():
            if self.sock.poll(int(HEARTBEAT * 1000)):
                frames = self.sock.recv_multipart()
                route, request = frames[0], decode(frames[1:])
                if request.type == "subscribe":
                    self.sock.send_multipart([route, *encode(reply_to(request, {}, "agent"))])
            if route is not None and self.beat_from is not None and time.monotonic() >= self.beat_from:
                self.sock.send_multipart([route, *encode(Message(type="agent.heartbeat", sender="agent"))])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def agent_side(tmp_path: Path) -> Iterator[tuple[AgentSide, str]]:
    endpoint = f"ipc://{tmp_path / 'agent.sock'}"
    side = AgentSide(endpoint)
    yield side, endpoint
    side.close()


def start_worker(endpoint: str, wait: str) -> subprocess.Popen[str]:
    """The worker, which then waits in a native call holding the GIL (`native`) or in a sleep (`sleep`)."""
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, endpoint, wait],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_worker_holding_the_gil_past_the_orphan_window_while_its_agent_beats_lives_on(
    agent_side: tuple[AgentSide, str],
) -> None:
    side, endpoint = agent_side
    worker = start_worker(endpoint, "native")
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "holding"
        side.beat_from = time.monotonic() + QUIET_AFTER_HOLDING
        output, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
        worker.wait()
    assert (worker.returncode, output.strip()) == (0, "alive"), output


def test_a_worker_whose_agent_answers_then_falls_silent_exits_as_an_orphan(agent_side: tuple[AgentSide, str]) -> None:
    _, endpoint = agent_side
    worker = start_worker(endpoint, "sleep")
    try:
        output, _ = worker.communicate(timeout=60)
    finally:
        worker.kill()
        worker.wait()
    assert worker.returncode == ORPHAN_EXIT_CODE, output
    assert "; this worker exits" in output and "alive" not in output, output
