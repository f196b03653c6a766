"""The host's way into a round, one request for all of its slots: the workers' `rank_and_size` requests go to the
rendezvous as the host's one `enter_round` (`HostEntry`), and their lookups of a round's key as one `kv_get`
(`RoundKeyLookups`).

HostEntry keeps each waiting worker's request by slot. An entry carries every slot waiting then; it is sent at once
when none is parked at the rendezvous or when every live worker of the host waits, else at the agent's next tick (the
workers of a reset ask within milliseconds of each other: one or two entries per host, not one per slot). A newer
entry replaces the parked one (the rendezvous answers that one with nothing; it is no longer resent). The reply
answers the slots whose answer was due; the others left the rendezvous's parking lot and go out again in the next
entry. A worker that exits is dropped (its agent also tells the rendezvous to `forget` it); a second process of a
slot replaces the first's request (`superseded`). An error reply fails the workers it was for, as each worker's own
request failed before.

RoundKeyLookups asks the rendezvous once per key, whatever the number of workers that wait for it, and keeps the
values of the last few round keys of the job (a round's key is set once in a job: the address of its store). Round
numbers start again with each job, so the values go when a job ends or another job's round begins: a job's round 1
must not be handed the store address of the round 1 before it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.bus.client import AsyncClient
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.service import Request, RequestError, field

ROUND_KEYS_KEPT = 8  # values of round keys kept: every slot of the host asks for its round's store address


@dataclass
class Waiting:
    request: Request
    after_round: int
    pid: int


class HostEntry:
    def __init__(
        self,
        host: str,
        slots: int,
        rendezvous: AsyncClient,
        live_slots: Callable[[], Collection[int]],
        on_rank: Callable[[int], None],
    ) -> None:
        self.host, self.slots, self.rendezvous = host, slots, rendezvous
        self.live_slots, self.on_rank = live_slots, on_rank
        self.waiting: dict[int, Waiting] = {}
        self.parked_id: str | None = None  # the host's entry parked at the rendezvous
        self.parked_slots: dict[int, tuple[int, int]] = {}  # its slots: local_rank -> (after_round, pid)

    def ask(self, request: Request) -> None:
        """A worker asks for its place in the round after `after_round`; its reply comes with the host's entry's."""
        local_rank = field(request.body, "local_rank", int)
        if not 0 <= local_rank < self.slots:
            raise RequestError("no_such_slot", f"host {self.host} has {self.slots} slot(s): no slot {local_rank}")
        waiting = Waiting(request, field(request.body, "after_round", int), field(request.body, "pid", int))
        previous = self.waiting.get(local_rank)
        if previous is not None:
            previous.request.fail("superseded", f"another process of slot {local_rank} asked for a round")
        self.waiting[local_rank] = waiting
        if self.parked_id is None or self.waiting.keys() >= set(self.live_slots()):
            self._send()

    def drop(self, local_rank: int, pid: int) -> None:
        """The worker `pid` of the slot exited: it no longer waits."""
        waiting = self.waiting.get(local_rank)
        if waiting is not None and waiting.pid == pid:
            del self.waiting[local_rank]

    def tick(self) -> None:
        """Send the slots that asked (or left) since the parked entry, in an entry that replaces it (an empty one
        withdraws it)."""
        if (self.waiting or self.parked_id is not None) and self._wanted() != self.parked_slots:
            self._send()

    def _wanted(self) -> dict[int, tuple[int, int]]:
        return {local_rank: (w.after_round, w.pid) for local_rank, w in self.waiting.items()}

    def _send(self) -> None:
        if self.parked_id is not None:
            self.rendezvous.cancel(self.parked_id)
        self.parked_slots = self._wanted()
        self.parked_id = self.rendezvous.send(
            "enter_round",
            {"host": self.host, "slots": [[lr, after, pid] for lr, (after, pid) in self.parked_slots.items()]},
            on_reply=self._answered,
            timeout=INTERVALS.parked_timeout,
        )

    def _answered(self, reply: Message) -> None:
        if reply.id != self.parked_id:
            return
        self.parked_id, sent = None, self.parked_slots
        self.parked_slots = {}
        if reply.error is not None:
            message = str(reply.body.get("message", ""))
            for local_rank, (_, pid) in sent.items():
                waiting = self.waiting.get(local_rank)
                if waiting is not None and waiting.pid == pid:
                    del self.waiting[local_rank]
                    waiting.request.fail(str(reply.error), message)
            return
        for local_rank, pid, answer in reply.body.get("answers", []):
            waiting = self.waiting.get(local_rank)
            if waiting is None or waiting.pid != pid:
                continue
            del self.waiting[local_rank]
            if "rank" in answer:
                self.on_rank(local_rank)
            waiting.request.reply(answer)
        if self.waiting:
            self._send()


class RoundKeyLookups:
    def __init__(self, host: str, rendezvous: AsyncClient) -> None:
        self.host, self.rendezvous = host, rendezvous
        self.waiting: dict[str, list[Request]] = {}
        self.values: OrderedDict[str, bytes] = OrderedDict()
        self.job_key: str | None = None

    def job_round(self, job_key: str) -> None:
        """A round of the job `job_key` begins: the values kept of another job's rounds go."""
        if job_key != self.job_key:
            self.job_ended()
            self.job_key = job_key

    def job_ended(self) -> None:
        self.values.clear()
        self.job_key = None

    def get(self, request: Request) -> None:
        """A worker looks a key up: answered from the values kept, or with the one lookup of the key in flight."""
        key = field(request.body, "key", str)
        if key in self.values:
            request.reply({}, raw=(self.values[key],))
        elif key in self.waiting:
            self.waiting[key].append(request)
        else:
            self.waiting[key] = [request]
            self.rendezvous.send(
                "kv_get",
                {"key": key, "host": self.host},
                round=request.msg.round,
                on_reply=lambda reply: self._answered(key, reply),
                timeout=INTERVALS.parked_timeout,
            )

    def _answered(self, key: str, reply: Message) -> None:
        waiters = self.waiting.pop(key, [])
        if reply.error is not None:
            for request in waiters:
                request.fail(str(reply.error), str(reply.body.get("message", "")))
            return
        if key.startswith("round/") and reply.raw:
            self.values[key] = reply.raw[0]
            while len(self.values) > ROUND_KEYS_KEPT:
                self.values.popitem(last=False)
        for request in waiters:
            request.reply(reply.body, reply.raw)
