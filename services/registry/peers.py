"""Peer: how the registry's loop talks to discovery or rendezvous: reads that never wait, writes that wait briefly;
and Pass: a driver pass written as one sequence of steps, each step's reads sent at once.

A read (`hosts`, `status`) is sent without blocking; its answer, an error or
its silence after `DEADLINE` reaches a callback from the loop. A read that
comes late is dropped (its request is no longer pending), and a read repeated
later asks again, so a lost or late read costs nothing. A write (a job's
preparation, a restore, a round, a blacklist) waits for its answer: see
`Peer.write`.

A `Pass` runs a generator that yields the `Read`s its next step needs and is
resumed with their answers, in the same order, once all of them arrived: the
pass reads top to bottom while the loop goes on serving between its steps.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from functools import partial
from typing import Any

from elastic_control_plane.bus.client import AsyncClient, Client, ServiceError, Unreachable
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.service import Service

TIMEOUT = 0.5  # a request unanswered this long is sent again
DEADLINE = 1.0  # and given up this long after it was first sent


class Peer:
    def __init__(self, service: Service, endpoint: str, sender: str) -> None:
        self.endpoint = endpoint
        self._reads = AsyncClient(service, endpoint, sender, service.security)
        self._writes = Client(
            endpoint, sender, security=service.security, ctx=service.ctx, timeout=TIMEOUT, deadline=DEADLINE
        )

    @property
    def reading(self) -> bool:
        """Is a read still waiting for its answer?"""
        return self._reads.in_flight > 0

    def read(
        self,
        msg_type: str,
        body: dict[str, Any],
        answered: Callable[[dict[str, Any]], None],
        failed: Callable[[Exception], None],
    ) -> None:
        """Ask without waiting: `answered(body)` with the answer, or `failed(ServiceError | Unreachable)`."""

        def on_reply(reply: Message) -> None:
            if reply.error is not None:
                failed(ServiceError(str(reply.error), str(reply.body.get("message", ""))))
            else:
                answered(reply.body)

        self._reads.send(
            msg_type,
            body,
            on_reply=on_reply,
            on_timeout=lambda: failed(Unreachable(self.endpoint, DEADLINE)),
            timeout=TIMEOUT,
            deadline=DEADLINE,
        )

    def write(self, msg_type: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send a write and wait for its answer; ServiceError or Unreachable.

        Blocking, on purpose and safely. On purpose: a write that is given up must never reach the peer later, and
        the Client drops it with its socket at the deadline, where a non-blocking request would stay queued on its
        socket and be applied by a restarted peer long after the driver gave up on it (a second round, a blacklist).
        Safely: the driver writes to a peer right after that peer answered a read of the same pass, or while
        answering an operator's or an agent's request (a submission, a slot given up) whose sender waits for the
        outcome; the wait is a live peer's answer, milliseconds, and only a peer that died in between holds the
        loop, once, for at most `DEADLINE`: the next pass's read finds it gone without waiting."""
        return self._writes.request(msg_type, body).body

    def close(self) -> None:
        self._writes.close()


@dataclass(frozen=True)
class Read:
    peer: Peer
    msg_type: str
    body: dict[str, Any]


Steps = Generator[list[Read], list[dict[str, Any]], None]


class Pass:
    """Runs `steps` from now on: each `yield` sends that step's reads at once, and the generator resumes with their
    answers once all arrived, if the pass is still `wanted()` then. A read that fails ends the pass (`blind(exc)`;
    the other answers of its step are dropped). `done()` runs once, however the pass ends."""

    def __init__(
        self,
        steps: Steps,
        wanted: Callable[[], bool],
        blind: Callable[[Exception], None],
        done: Callable[[], None],
    ) -> None:
        self._steps, self._wanted, self._blind, self._done = steps, wanted, blind, done
        self._running = True
        self._answers: list[dict[str, Any] | None] = []
        self._resume(None)

    def _resume(self, answers: list[dict[str, Any]] | None) -> None:
        try:
            reads = next(self._steps) if answers is None else self._steps.send(answers)
        except StopIteration:
            self._end()
            return
        except BaseException:
            self._end()
            raise
        self._answers = [None] * len(reads)
        for index, read in enumerate(reads):
            read.peer.read(read.msg_type, read.body, partial(self._answered, index), self._failed)

    def _answered(self, index: int, answer: dict[str, Any]) -> None:
        if not self._running:
            return
        self._answers[index] = answer
        if any(a is None for a in self._answers):
            return
        if self._wanted():
            self._resume([a for a in self._answers if a is not None])
        else:
            self._steps.close()
            self._end()

    def _failed(self, exc: Exception) -> None:
        if not self._running:
            return
        self._blind(exc)
        self._steps.close()
        self._end()

    def _end(self) -> None:
        self._running = False
        self._done()
