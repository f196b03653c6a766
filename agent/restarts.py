"""The restart policy of a host's slots: when a crashed worker is restarted in place, and when the host gives up.

A worker that dies on its own (not stopped by its agent, exit code other than
0) is a crash. Its agent restarts the slot in place: at once for the first
crash within the job's `restart_window`, then after 1, 2, 4 ... seconds
(at most 30) for each further one, so a slot that crashes on every start never
spins. A slot that crashes more than `max_restarts` times within the window
is given up: the agent stops restarting it and its host is blacklisted
(Horovod's rule, with the job's blacklist cooldown). `max_restarts` 0 is
exactly Horovod's behaviour: the first crash blacklists the host.

Pure logic on an injected clock; each slot's history holds only crashes inside
the window, so it stays small however long the job runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.job.spec import JobSpec


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = JobSpec.max_restarts
    window: float = JobSpec.restart_window

    @classmethod
    def of_plan(cls, plan: JobPlan) -> RestartPolicy:
        """The policy a job's plan carries (its spec kept the rules when the plan was read)."""
        return cls(plan.spec.max_restarts, plan.spec.restart_window)


def backoff(crashes_in_window: int) -> float:
    """Delay before the restart that follows the n-th crash within the window."""
    if crashes_in_window <= 1:
        return 0.0
    return min(INTERVALS.restart_backoff_cap, INTERVALS.restart_backoff_first * 2 ** (crashes_in_window - 2))


@dataclass
class CrashHistory:
    crashes: dict[int, list[float]] = field(default_factory=dict)

    def record(self, slot: int, now: float, policy: RestartPolicy) -> float | None:
        """Note a crash of `slot`; return the delay before restarting it, or None when the slot is given up."""
        recent = [t for t in self.crashes.get(slot, []) if now - t < policy.window] + [now]
        self.crashes[slot] = recent[-(policy.max_restarts + 1) :]
        if len(recent) > policy.max_restarts:
            return None
        return backoff(len(recent))

    def count(self, slot: int) -> int:
        return len(self.crashes.get(slot, []))

    def forget_slot(self, slot: int) -> None:
        """The slot was given up: when it comes back (its host's cooldown ended) it starts with a fresh count."""
        self.crashes.pop(slot, None)

    def forget(self) -> None:
        """A new job: earlier crashes do not count against it."""
        self.crashes.clear()


def give_up_reason(crashes: int, policy: RestartPolicy) -> str:
    if policy.max_restarts == 0:
        return "crashed; --max-restarts 0 blacklists its host at the first crash"
    return (
        f"crashed {crashes} times within {policy.window:g}s (--max-restarts {policy.max_restarts}); its host is "
        "blacklisted"
    )
