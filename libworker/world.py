"""The worker's place in the job: which round it is in, its slot, and the process group of that round.

`enter_next_round()` asks the rendezvous (through the agent) for a round newer than the
one this process was last in, and initialises `torch.distributed` on that
round's store: rank 0 of the round serves a TCPStore and publishes its address
under the round's prefix in the rendezvous key-value store; the others read it
there (parked until it is set) and connect. Entering the round is
slot_processes/rounds.py's, shared with torchrun-mode slot supervisors. The process group is built once
every rank has reached the store, and gloo's group on a store whose waits end
at the round's abort (libworker.forming_store), so a peer that dies while the
round forms ends the others' wait at the control plane's abort, not after the
collective timeout. A worker whose slot is not in the new round leaves: the process
exits 0 at once.

Leaving a round releases its process group, its store connections and
threads with it, even while a collective of it is still stuck on a hung or
departed peer: a group whose works are still pending is held aside until they
end (at the latest at the collective timeout) while the next round forms, as
waiting for them could wait for a survivor that waits in turn (every work
launched in a round is tracked for this); NCCL communicators of an abandoned
round are aborted first,
and a group that failed to form leaves nothing that would make the next one
differ from a fresh process's (what torch does with them is in
libworker.torch_compat). The release holds
`world.lock`, as `abort()` does, so an abort arriving on the event thread
never races it.

A standby process (started by `elastic-agent --standby N`) first waits in
`enter_next_round()` until its agent gives it the slot of a crashed worker; from then on
it is that slot's worker: it binds the slot's GPU and joins like any other.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NoReturn

import torch.distributed as dist

from elastic_control_plane.bus.client import ServiceError, Unreachable
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.job.assignments import SlotInfo
from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.slot_processes import rounds, wait_record
from elastic_control_plane.slot_processes.agent_link import AgentLink, link_to_agent, worker_pid
from elastic_control_plane.slot_processes.bound_store import serve_store
from libworker import devices, torch_compat
from libworker.errors import WorkerInternalError
from libworker.forming_store import AbortableStore, RoundFormationAborted

FLIGHT_PRUNE_MIN = 64
HOST_ADDED, HOST_REMOVED = 1, 2
ARRIVED_KEY, ARRIVAL_POLL_MAX = "ranks_arrived", 0.02


@dataclass
class World:
    link: AgentLink | None = None
    timing: Timing = field(default_factory=Timing)
    round: int = 0
    holds_state: bool = False
    slot: dict[str, Any] = field(default_factory=dict)
    poisoned: bool = False
    aborted_round: int = 0
    backend: str = ""
    # The Python store the round's gloo groups were made on: C++ keeps calling it (a process set's group is built
    # on it mid-round) after enter_next_round returns, and its methods vanish with its last Python reference.
    round_store: dist.Store | None = None
    shut_down: bool = False
    listeners: list[Any] = field(default_factory=list)
    round_entered_hooks: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: list[Any] = field(default_factory=list)
    prune_at: int = FLIGHT_PRUNE_MIN
    retired: torch_compat.RetiredGroups = field(default_factory=torch_compat.RetiredGroups)
    waits: wait_record.WaitRecord | wait_record.NoRecord = field(default_factory=wait_record.NoRecord)

    def track(self, work: Any) -> None:
        """Remember a launched work of this round until it is seen ended (pruned as the list doubles), so that
        leaving the round knows which are still pending; and drop past rounds' groups whose works have ended."""
        self.in_flight.append(work)
        if len(self.in_flight) >= self.prune_at:
            self.in_flight = self._unfinished()
            self.prune_at = max(FLIGHT_PRUNE_MIN, 2 * len(self.in_flight))
        if self.retired.rounds:
            self.retired.drop_ended()

    def take_pending(self) -> list[Any]:
        """The works of this round that have not ended; the round's list starts afresh."""
        pending = self._unfinished()
        self.in_flight, self.prune_at = [], FLIGHT_PRUNE_MIN
        return pending

    def _unfinished(self) -> list[Any]:
        return [work for work in self.in_flight if not work.is_completed()]

    def on_event(self, msg: Message) -> None:
        if msg.type == "abort":
            self.abort_round(int(msg.body.get("round", 0)))
        elif msg.type == "hosts_updated":
            update = (HOST_ADDED if msg.body.get("added") else 0) | (HOST_REMOVED if msg.body.get("removed") else 0)
            for state in list(self.listeners):
                state.on_hosts_updated(float(msg.body.get("timestamp", 0.0)), update)

    def abort_round(self, round_number: int) -> None:
        """The control plane aborted a round: this one's collectives end; a round this worker is still joining (the
        abort overtook the join's answer) ends as soon as it is joined."""
        if round_number == self.round:
            self.abort()
        elif round_number > self.round:
            with self.lock:
                self.aborted_round = max(self.aborted_round, round_number)

    def abort(self) -> None:
        """End every collective of this round: waits in slices see the flag and raise WorkerInternalError; NCCL
        communicators are aborted, which ends their kernels (a stream wait would not notice a flag)."""
        with self.lock:
            self.aborted_round = self.round
            if dist.is_initialized() and self.uses_nccl():
                torch_compat.abort_nccl(dist.group.WORLD)

    def uses_nccl(self) -> bool:
        return "nccl" in self.backend


world = World()


def leave_process_group_at_exit() -> None:
    """Leave torch.distributed cleanly; registered to run at exit (Horovod's `shutdown()`, which keeps the worker in
    its round, is libworker.basics.shutdown)."""
    release_process_group()


def tell_agent_the_script_ended() -> None:
    """At exit, before the interpreter tears down: the user's script has ended, with an exception that escaped it
    or not (`sys.last_value` is set only for one). The agent then knows a signal that kills this process from
    here on (a C++ destructor in teardown) came after the script's work, not during it. A request, not a notice:
    the process must not exit before the agent heard it."""
    if world.link is None:
        return
    try:
        world.link.requests.request(
            "script_ended",
            {"pid": worker_pid(), "uncaught_exception": hasattr(sys, "last_value")},
            timeout=1.0,
            deadline=2.0,
        )
    except (Unreachable, ServiceError):
        pass


def _connect() -> AgentLink:
    endpoint = os.environ.get(WorkerEnv.AGENT)
    if not endpoint:
        raise RuntimeError("libworker.init() must run in a worker started by elastic-agent (ELASTIC_AGENT is not set)")
    world.timing = Timing.from_env()
    world.waits = wait_record.record_from_env()
    wait_record.answer_stack_dumps()
    link = link_to_agent(world.timing)
    link.listeners.append(world.on_event)
    atexit.register(leave_process_group_at_exit)
    atexit.register(tell_agent_the_script_ended)
    link.wait_subscribed(5.0)
    return link


def release_process_group() -> None:
    """Release the current round's process group (see the module docstring)."""
    with world.lock:
        world.retired.drop_ended()
        if not dist.is_initialized():
            torch_compat.forget_a_default_group_that_failed_to_form()
            return
        torch_compat.destroy_default_group(world.poisoned and world.uses_nccl(), world.take_pending(), world.retired)


def _leave() -> NoReturn:
    """This slot is not in the new round: the worker's job is done, it exits cleanly."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _round_store(link: AgentLink, timeout: timedelta) -> dist.Store:
    """The round's TCPStore: rank 0 serves it and publishes its address; the others connect to it
    (slot_processes.rounds)."""
    if world.slot["rank"] == 0:
        store = serve_store(advertise_address(), timeout, world.slot["size"])
        try:
            rounds.publish_store(
                link,
                world.slot,
                f"{advertise_address()}:{store.port}",
                lambda: world.aborted_round >= world.round,
                timeout.total_seconds(),
            )
        except rounds.RoundAborted as exc:
            raise _formation_failed(str(exc)) from None
        return store
    try:
        address = rounds.read_store(
            link, world.slot, lambda: world.aborted_round >= world.round, timeout.total_seconds()
        )
    except rounds.RoundAborted as exc:
        raise _formation_failed(str(exc)) from None
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world.slot["size"], is_master=False, timeout=timeout)


def advertise_address() -> str:
    return os.environ.get(WorkerEnv.ADVERTISE_ADDR, "127.0.0.1")


def _wait_for_a_slot(link: AgentLink) -> None:
    """A standby waits here, started and imported, until its agent admits it to a slot; then it binds its GPU."""
    try:
        rounds.wait_for_a_slot(link)
    except (Unreachable, ServiceError) as exc:
        raise WorkerInternalError(f"standby was not admitted: {exc}") from None
    devices.bind_device()


def enter_next_round() -> None:
    """Enter the next round (slot_processes.rounds): park at the rendezvous until it is complete, then set up
    torch.distributed."""
    if world.link is None:
        world.link = _connect()
    if devices.is_standby():
        _wait_for_a_slot(world.link)
    release_process_group()
    local_rank = int(os.environ.get(WorkerEnv.LOCAL_RANK, "0"))
    try:
        slot = rounds.enter_round(world.link, local_rank, world.round)
    except (Unreachable, ServiceError) as exc:
        raise WorkerInternalError(f"cannot enter a round: {exc}") from None
    if slot is None:
        _leave()
    with world.lock:
        world.slot = slot
        world.round = int(slot["round"])
        world.poisoned = False
    world.waits.begin_round(world.round)
    os.environ.update(
        rounds.round_environment(SlotInfo(**{name: slot[name] for name in SlotInfo.__dataclass_fields__}))
    )
    timeout = timedelta(seconds=world.timing.collective_timeout)
    try:
        store = dist.PrefixStore(world.slot["prefix"], _round_store(world.link, timeout))
    except WorkerInternalError:
        raise
    except (RuntimeError, dist.DistError, Unreachable, ServiceError) as exc:
        world.poisoned = True
        raise WorkerInternalError(f"store of round {world.round} failed: {exc}") from None
    _await_every_rank(store)
    world.backend = devices.backend()
    group_timeout = timeout
    if world.backend == "gloo":
        round_number = world.round
        store = AbortableStore(store, lambda: world.aborted_round >= round_number)
        world.round_store = store
        timeout = torch_compat.gloo_formation_timeout(world.timing.collective_timeout)
        group_timeout = judged_group_timeout() if isinstance(world.waits, wait_record.WaitRecord) else group_timeout
    try:
        dist.init_process_group(
            world.backend, store=store, rank=world.slot["rank"], world_size=world.slot["size"], timeout=timeout
        )
    except RoundFormationAborted as exc:
        raise _formation_failed(str(exc)) from None
    except (RuntimeError, dist.DistError) as exc:
        world.poisoned = True
        raise WorkerInternalError(f"process group of round {world.round} failed to start: {exc}") from None
    if group_timeout != timeout:
        torch_compat.set_group_timeout(group_timeout)
    for hook in world.round_entered_hooks:
        try:
            hook()
        except (RuntimeError, dist.DistError) as exc:
            world.poisoned = True
            raise WorkerInternalError(f"setting up round {world.round} failed: {exc}") from None


def judged_group_timeout() -> timedelta:
    """gloo's own timeout for a collective when the agent watches this worker's waits, set once the group formed
    (it forms within the collective timeout: torch_compat.gloo_formation_timeout; formed with this one, a peer dying
    while it formed outlasted the registry's hung timeout, and every survivor was judged hung). The wait loops go
    past the collective timeout while the registry judges the rank they wait for (libworker.collectives.timed_out),
    which it kills by the job's hung timeout at the latest, so gloo must not end the wait first; it still ends, so a
    round's group retired with works pending is released (torch_compat.RetiredGroups). Without a watching agent,
    and for NCCL, the collective timeout is gloo's and NCCL's."""
    try:
        hung_timeout = float(os.environ.get(WorkerEnv.HUNG_TIMEOUT, JobSpec.hung_timeout))
    except ValueError:
        hung_timeout = JobSpec.hung_timeout
    return timedelta(seconds=world.timing.collective_timeout + max(hung_timeout, world.timing.collective_timeout))


def _await_every_rank(store: dist.Store) -> None:
    """Wait until every rank of the round has reached its store, before any builds the process group: a peer that
    dies before it arrives ends the wait at the control plane's abort (or the store's loss, when it was rank 0),
    not after the collective timeout that a group connecting to a dead peer waits out. Polled, since a timed store
    wait cannot be interrupted; the pause grows from 1 ms to ARRIVAL_POLL_MAX."""
    size, round_number = int(world.slot["size"]), world.round
    deadline = time.monotonic() + world.timing.collective_timeout
    pause = 0.001
    arrived = _count_arrival(store, 1)
    while arrived < size:
        if world.aborted_round >= round_number:
            raise _formation_failed(f"aborted while it formed ({arrived} of {size} ranks had arrived)")
        if time.monotonic() > deadline:
            raise _formation_failed(
                f"did not form within {world.timing.collective_timeout:g}s ({arrived} of {size} ranks arrived)"
            )
        time.sleep(pause)
        pause = min(2 * pause, ARRIVAL_POLL_MAX)
        arrived = _count_arrival(store, 0)


def _count_arrival(store: dist.Store, increment: int) -> int:
    try:
        return int(store.add(ARRIVED_KEY, increment))
    except (RuntimeError, dist.DistError) as exc:
        raise _formation_failed(f"lost its store while it formed: {exc}") from None


def _formation_failed(reason: str) -> WorkerInternalError:
    """The round cannot form: this worker joins the next one (as after a failed collective)."""
    world.poisoned = True
    return WorkerInternalError(f"round {world.round} {reason}")


def require_joined() -> dict[str, Any]:
    if not world.slot or world.shut_down:
        raise RuntimeError(
            "call libworker.init() first" if not world.slot else "libworker was shut down: call init() again first"
        )
    return world.slot
