"""The agent's book of its host's slots: what it knows and decides about them, with no process and no message.

Per job: the restart policy and each slot's crash history (agent/restarts.py),
the slots reported down to discovery (with the version that orders those
reports), when each crashed slot (or the standby pool, key STANDBY) is due a
new process, whether standbys were given up, which slots are warming up
(a host joining a running job) and which have entered a round, and whether the
host drains. The keeper (agent/keeper.py), the only one that changes it, asks
it what to do and carries it out: starting and signalling processes, sending
reports. Pure logic on an injected clock, driven by
tests/unit/test_agent_slots.py.

A crashed slot (`crashed`) is taken by a waiting standby at once; otherwise it
goes down and is due a replacement after the policy's back-off; past
`--max-restarts` it is given up: it stays up (its host is blacklisted by the
registry and comes back whole when the cooldown ends) and its crash history
starts afresh, as a Horovod host's does after its cooldown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from elastic_control_plane.agent.restarts import CrashHistory, RestartPolicy, give_up_reason
from elastic_control_plane.agent.workers import STANDBY


class Remedy(Enum):
    TAKE_STANDBY = "take_standby"  # a waiting standby takes the slot now
    RESTART = "restart"  # the slot is down; a replacement is due after `delay`
    GIVE_UP = "give_up"  # no more restarts: the host is blacklisted


@dataclass(frozen=True)
class CrashVerdict:
    remedy: Remedy
    delay: float = 0.0
    reason: str = ""


@dataclass
class SlotBook:
    clock: Callable[[], float]
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    crashes: CrashHistory = field(default_factory=CrashHistory)
    job_running: bool = False
    down: frozenset[int] = frozenset()
    down_version: int = 0
    restart_at: dict[int, float] = field(default_factory=dict)
    standbys_given_up: bool = False
    warming: set[int] = field(default_factory=set)
    warm_deadline: float = 0.0
    entered: set[int] = field(default_factory=set)
    draining_since: float | None = None

    # -- the job ---------------------------------------------------------------------------------
    def start_job(self, policy: RestartPolicy, new_job: bool) -> None:
        """A round or job state named the job (again); a new job starts with no crashes and standbys allowed."""
        if new_job:
            self.crashes.forget()
            self.standbys_given_up = False
        self.policy, self.job_running = policy, True

    def end_job(self) -> None:
        self.job_running = False
        self.restart_at.clear()

    def host_lost(self) -> None:
        """Discovery declared the host lost: its workers are stopped and it registers afresh with every slot up."""
        self.restart_at.clear()
        self.down = frozenset()

    # -- down slots (reported to discovery) ------------------------------------------------------
    def set_down(self, down: frozenset[int]) -> bool:
        """Record the slots that are down; True when that changed (a new report is due, with the next version)."""
        if down == self.down:
            return False
        self.down, self.down_version = down, self.down_version + 1
        return True

    # -- crashes -----------------------------------------------------------------------------------
    def is_crash(self, code: int, stop_requested: bool) -> bool:
        """A worker that died on its own during the job (not stopped by its agent, not finished, not draining)."""
        return code != 0 and not stop_requested and self.job_running and self.draining_since is None

    def crashed(self, local_rank: int, standby_waiting: bool) -> CrashVerdict:
        now = self.clock()
        delay = self.crashes.record(local_rank, now, self.policy)
        if delay is None:
            reason = give_up_reason(self.crashes.count(local_rank), self.policy)
            self.crashes.forget_slot(local_rank)
            self.restart_at.pop(local_rank, None)
            return CrashVerdict(Remedy.GIVE_UP, reason=reason)
        if standby_waiting:
            return CrashVerdict(Remedy.TAKE_STANDBY)
        self.restart_at[local_rank] = now + delay
        return CrashVerdict(Remedy.RESTART, delay)

    def due(self) -> list[int]:
        """Slots (and STANDBY, for the pool) whose back-off has ended; each is returned once."""
        now = self.clock()
        ready = [key for key, at in self.restart_at.items() if now >= at]
        for key in ready:
            del self.restart_at[key]
        return ready

    def restarting(self) -> list[int]:
        """Crashed slots waiting out their back-off, lowest first."""
        return sorted(key for key in self.restart_at if key != STANDBY)

    def filled(self, local_rank: int) -> None:
        """The slot has a process again: no replacement is due."""
        self.restart_at.pop(local_rank, None)

    def may_start_worker(self) -> bool:
        return self.job_running and self.draining_since is None

    # -- standbys ----------------------------------------------------------------------------------
    def may_keep_standbys(self) -> bool:
        return self.may_start_worker() and not self.standbys_given_up and STANDBY not in self.restart_at

    def standby_died(self) -> float | None:
        """A standby died while waiting (during the job): the delay before the pool is topped up, or None when
        standbys are given up for this job (they kept dying)."""
        now = self.clock()
        delay = self.crashes.record(STANDBY, now, self.policy)
        if delay is None:
            self.standbys_given_up = True
            return None
        self.restart_at[STANDBY] = now + delay
        return delay

    # -- warming up: a host that joins a running job -----------------------------------------------
    def begin_warm_up(self, slots: int, limit: float) -> None:
        self.warming = set(range(slots))
        self.warm_deadline = self.clock() + limit

    def warmed(self, local_rank: int) -> bool:
        """The slot's process waits for a round (or died); True when that was the last one warming."""
        if local_rank not in self.warming:
            return False
        self.warming.discard(local_rank)
        return not self.warming

    def warm_up_expired(self) -> set[int]:
        """The slots still warming when the warm-up limit has passed (they are given up on); empty otherwise."""
        if not self.warming or self.clock() <= self.warm_deadline:
            return set()
        late, self.warming = self.warming, set()
        return late

    # -- rounds: which slots' processes have entered one --------------------------------------------
    def slot_entered(self, local_rank: int) -> None:
        self.entered.add(local_rank)

    def slot_left(self, local_rank: int) -> None:
        """The slot's process exited."""
        self.entered.discard(local_rank)

    # -- draining ----------------------------------------------------------------------------------
    def begin_drain(self) -> bool:
        """False when the host already drains (a second SIGTERM: stop now)."""
        if self.draining_since is not None:
            return False
        self.draining_since = self.clock()
        self.restart_at.clear()
        return True

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def drain_overdue(self, timeout: float) -> bool:
        return self.draining_since is not None and self.clock() - self.draining_since >= timeout
