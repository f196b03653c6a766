"""libworker's workarounds for torch behaviour, each with the torch version it was written and measured for.

Everything here leans on how a given torch release behaves rather than on
what its API promises: how a timed wait on a Work says that it ran out,
what destroying a process group does to a collective stuck in it, and how
NCCL communicators are aborted, what a process group that failed to form
leaves behind, and how long gloo waits for a peer that died while the group
formed. When torch is upgraded, these are the places to measure again
(bench/RESULTS.md has the resource measurements). Two choices elsewhere also
follow torch 2.13 and are design rather than workarounds: gloo's missing
dtypes travel widened or as bytes (libworker.wire), and each round bootstraps
from a TCPStore because a Python Store cannot back gloo (libworker.world;
docs/design-notes.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

RETIRED_MAX = 4


def ended_within(work: Any, timeout: timedelta) -> bool:
    """Wait up to `timeout` for a torch.distributed Work: True when it ended, False when it is still pending. A work
    that failed raises its error (RuntimeError or dist.DistError).

    Measured on torch 2.13 (gloo): `Work.wait(timeout)` raises the same error for a wait that ran out as for a
    work that failed, so they are told apart by the work's state, not the error's text: a wait that ran out leaves
    `is_completed()` False, a peer's death sets it. A work that completes just as the wait runs out is asked once
    more, without a timeout, how it ended."""
    try:
        work.wait(timeout)
        return True
    except (RuntimeError, dist.DistError):
        if not work.is_completed():
            return False
    work.wait()
    return True


def abort_nccl(group: Any) -> None:
    """Abort a process group's NCCL communicators, which ends their kernels and frees their GPU memory (waiting on
    the stream would never notice an abort).

    Written for torch 2.13, whose ProcessGroup has `abort()`. A group aborted already raises RuntimeError, and a
    torch without communicator abort AttributeError (not measured): both are let go, since destroying the group
    still releases what it can."""
    try:
        group.abort()
    except (RuntimeError, AttributeError):
        pass


def destroy_default_group(abort_nccl_first: bool, pending: list[Any], retired: RetiredGroups) -> None:
    """Destroy the default process group, its store connections and threads with it, even while a collective of
    it is still stuck on a hung or departed peer. `abort_nccl_first`: the group was abandoned with NCCL
    communicators in it, which are aborted before the destroy (that ends their works). `pending`: works of the
    round that had not ended; with any (and no abort), every group of the round is handed to `retired` rather
    than destroyed now.

    Measured on torch 2.13 (gloo): a group's destructor joins its worker threads, so it waits for every work in
    flight. A work whose peer died ends at once (the peer's connections are closed), but one that waits for data
    from a live peer that abandoned the same collective waits out its timeout: two survivors that each left
    such a work behind (a gradient bucket launched ahead of the one that failed) block each other's destroy for
    the whole collective timeout. `ProcessGroup.abort()` does not end gloo work. Torch forgets a group
    (`destroy_process_group`) without destroying it while a reference to it is held, and the next round's
    group forms beside it; so a group with pending works is held until they end (bench/RESULTS.md: fds and
    threads stay flat over repeated resets)."""
    if abort_nccl_first:
        abort_nccl(dist.group.WORLD)
    elif pending:
        retired.retire(RetiredRound(groups=tuple(dist.distributed_c10d._world.pg_map), works=tuple(pending)))
    dist.destroy_process_group()


@dataclass(frozen=True)
class RetiredRound:
    """The process groups of a round left with works still pending, and those works."""

    groups: tuple[Any, ...]
    works: tuple[Any, ...]

    def ended(self) -> bool:
        return all(work.is_completed() for work in self.works)


@dataclass
class RetiredGroups:
    """Past rounds' process groups held until their pending works end (at the latest at their collective timeout,
    which gloo enforces), then dropped: destroying a group whose works have ended returns at once."""

    rounds: list[RetiredRound] = field(default_factory=list)

    def retire(self, retired: RetiredRound) -> None:
        """Hold a round's groups; past RETIRED_MAX the oldest is dropped anyway (its destructor waits for its works)."""
        self.rounds.append(retired)
        if len(self.rounds) > RETIRED_MAX:
            self.rounds.pop(0)

    def drop_ended(self) -> None:
        self.rounds = [retired for retired in self.rounds if not retired.ended()]


def forget_a_default_group_that_failed_to_form() -> None:
    """Reset what a default process group that failed to form (a peer died or hung while it connected) leaves
    behind, so this process names its next round's group as a process that never had one does.

    Measured on torch 2.13: torch names a group without explicit ranks by a process-wide counter
    (`_world.group_count`), which becomes part of the group's keys in the store; `init_process_group` counts before
    it connects, and only `destroy_process_group` of a default group that exists resets the count. A survivor whose
    formation failed would otherwise look for its peers under group "1" while a replacement, fresh, writes under
    group "0": every later round of theirs times out forming. A failed formation registers nothing else (the group
    is entered in `_world` only once its backend connected)."""
    dist.distributed_c10d._world.group_count = 0


GLOO_LISTENER_WAITS = 5


def gloo_formation_timeout(bound: float) -> timedelta:
    """The timeout to form a gloo group with so that a peer dying while it forms ends the formation within `bound`
    seconds. Measured on torch 2.13 (gloo's tcp transport): of each pair, the side whose address sorts first waits
    for the other to connect, without seeing the store or any abort; a peer that died after publishing its address
    is waited for GLOO_LISTENER_WAITS times the group's timeout (25 s for 5 s), while the connecting side is refused
    at once."""
    return timedelta(seconds=bound / GLOO_LISTENER_WAITS)


def set_group_timeout(timeout: timedelta) -> None:
    """Change the default process group's timeout for the collectives after its formation. torch 2.13 offers it as
    `_set_pg_timeout` only (gloo and NCCL backends)."""
    dist.distributed_c10d._set_pg_timeout(timeout)


def default_store() -> dist.Store:
    """The store the round's default process group was built on. torch 2.13 keeps it (`_get_default_store`) but
    hands it out through no public function; negotiation uses it for join notices (libworker.negotiation)."""
    return dist.distributed_c10d._get_default_store()
