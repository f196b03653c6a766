"""Entering a round, one way for every process an agent starts for a slot: libworker's workers (Horovod mode) and
torchrun-mode slot supervisors (slot_processes/torchrun_slot.py).

- A standby first waits for a slot (`wait_for_a_slot`): its agent admits it to the slot of a crashed worker, and the
  slot's local rank becomes its own (its environment and its link say so from then on).
- `enter_round` asks the agent for the round after the one this process was last in; the agent parks the request at
  the rendezvous until the round is complete, and the answer is the slot's place in it (rank, sizes, the round's
  key prefix, its hosts' timestamp...), or None when the slot is not in it (the process leaves).
- The round's store: rank 0 serves one and publishes its address (`host:port`) under the round's prefix in the
  rendezvous key-value store, `publish_store` (sent again while the rendezvous refuses it for now); the other ranks
  read it there, `read_store` (parked until it is set).
  A round the control plane aborted before a rank read its address, or while it waited, is not formed: the store's
  server may be gone (`RoundAborted`).

`round_environment` is a worker's place in its round as torch.distributed's and horovodrun's variables: the agent sets
them when it starts a Horovod-mode worker for a known slot, libworker again at every round it enters.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from elastic_control_plane.bus.client import TEMPORARY_REFUSALS, ServiceError
from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.job.assignments import SlotInfo
from elastic_control_plane.slot_processes.agent_link import AgentLink, worker_pid

ENTRY_DEADLINE = 7 * 24 * 3600.0  # a parked round entry waits as long as the job may wait for its round
STORE_KEY = "store"
PUBLISH_RETRY_FIRST = 0.05  # rank 0's next try at publishing its store's address after a refusal for now
PUBLISH_RETRY_MAX = 1.0


class RoundAborted(Exception):
    """The control plane aborted the round before this rank reached its store."""


def wait_for_a_slot(link: AgentLink) -> int:
    """A standby waits here, started and imported, until its agent admits it to a slot; the slot's local rank."""
    reply = link.requests.request("standby", {"pid": worker_pid()}, timeout=5.0, deadline=ENTRY_DEADLINE)
    local_rank = int(reply.body["local_rank"])
    os.environ.update({WorkerEnv.LOCAL_RANK: str(local_rank), "LOCAL_RANK": str(local_rank)})
    del os.environ[WorkerEnv.STANDBY]
    link.local_rank = local_rank
    return local_rank


def enter_round(link: AgentLink, local_rank: int, after_round: int) -> dict[str, Any] | None:
    """The slot's place in the first round after `after_round`, once that round is complete; None when the slot is
    not in it."""
    reply = link.requests.request(
        "rank_and_size",
        {"local_rank": local_rank, "after_round": after_round, "pid": worker_pid()},
        timeout=5.0,
        deadline=ENTRY_DEADLINE,
    )
    return None if reply.body.get("removed") else dict(reply.body)


def publish_store(
    link: AgentLink, slot: dict[str, Any], address: str, aborted: Callable[[], bool], deadline: float
) -> None:
    """Rank 0: the round's store is served at `address` (`host:port`). A refusal for now (`unavailable`: the
    rendezvous could not write the key to its store, an etcd that did not answer for a moment) is no answer: the
    write is sent again after a backoff until it is taken, the round is aborted (RoundAborted), or `deadline`
    seconds have passed (the refusal is raised); the other ranks wait for the address meanwhile (`read_store`)."""
    give_up_at, pause = time.monotonic() + deadline, PUBLISH_RETRY_FIRST
    while True:
        try:
            link.requests.request("kv_set", {"key": f"{slot['prefix']}{STORE_KEY}"}, raw=(address.encode(),))
            return
        except ServiceError as exc:
            if exc.code not in TEMPORARY_REFUSALS or time.monotonic() + pause > give_up_at:
                raise
            refused = exc.message
        if aborted():
            raise RoundAborted(f"was aborted while the rendezvous refused its store's address for now ({refused})")
        time.sleep(pause)
        pause = min(2 * pause, PUBLISH_RETRY_MAX)


def read_store(link: AgentLink, slot: dict[str, Any], aborted: Callable[[], bool], deadline: float) -> str:
    """The address (`host:port`) rank 0 published for the round's store, waited for up to `deadline` seconds;
    RoundAborted when `aborted()` says the round was aborted before or while this rank waited for it."""
    if aborted():
        raise RoundAborted("was aborted before this rank reached its store")
    reply = link.requests.request("kv_get", {"key": f"{slot['prefix']}{STORE_KEY}"}, timeout=5.0, deadline=deadline)
    if aborted():
        raise RoundAborted("was aborted before this rank reached its store (its server may be gone)")
    return reply.raw[0].decode()


def round_environment(slot: SlotInfo) -> dict[str, str]:
    """A worker's place in its round as torch.distributed's and horovodrun's (Gloo) variables."""
    values = {
        "RANK": slot.rank,
        "WORLD_SIZE": slot.size,
        "LOCAL_RANK": slot.local_rank,
        "LOCAL_WORLD_SIZE": slot.local_size,
        "GROUP_RANK": slot.cross_rank,
        "HOROVOD_RANK": slot.rank,
        "HOROVOD_SIZE": slot.size,
        "HOROVOD_LOCAL_RANK": slot.local_rank,
        "HOROVOD_LOCAL_SIZE": slot.local_size,
        "HOROVOD_CROSS_RANK": slot.cross_rank,
        "HOROVOD_CROSS_SIZE": slot.cross_size,
        "HOROVOD_HOSTNAME": slot.hostname,
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
    }
    return {name: str(value) for name, value in values.items()}
