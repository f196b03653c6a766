"""Peer: how the registry's loop talks to discovery or rendezvous: reads that never wait, writes that wait briefly.

A read (`hosts`, `status`) is sent without blocking; its answer, an error or
its silence after `DEADLINE` reaches a callback from the loop. A read that
comes late is dropped (its request is no longer pending), and a read repeated
later asks again, so a lost or late read costs nothing. A write (a job's
preparation, a restore, a round, a blacklist) waits for its answer: see
`Peer.write`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bus.client import AsyncClient, Client, ServiceError, Unreachable
from bus.envelope import Message
from bus.service import Service

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
