"""The host's standbys: spare worker processes waiting in `init()` for a slot, handed out longest-waiting first.

A standby is started like any worker (agent/workers.py) with local rank
STANDBY; once it waits in `init()` it has asked its agent for a slot (a
`standby` request the agent parks here, unanswered). Taking a standby pops
the longest-waiting one with its parked request; the agent answers that
request with the slot's local rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_control_plane.agent.workers import Worker, reap
from elastic_control_plane.bus.service import Request
from elastic_control_plane.job.plan import JobPlan

DEFAULT_FORKED_STANDBYS = 1  # without --standby: one per host where the fork server runs (none where it does not,
# nor in torchrun mode, where a crashed command's supervisor lives on and forks the next round's)


def standbys_wanted(standby: int | None, plan: JobPlan) -> int:
    """How many standbys a host keeps for the job: `--standby`, else the default."""
    if standby is not None:
        return standby
    return 0 if plan.spec.mode == "torchrun" else DEFAULT_FORKED_STANDBYS


@dataclass
class StandbyPool:
    processes: dict[int, Worker] = field(default_factory=dict)
    waiting: dict[int, Request] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.processes)

    def add(self, worker: Worker) -> None:
        self.processes[worker.pid] = worker

    def park(self, pid: int, request: Request) -> None:
        self.waiting[pid] = request

    def take(self) -> tuple[Worker, Request] | None:
        """The longest-waiting standby and its parked request, no longer in the pool; None when none waits."""
        if not self.waiting:
            return None
        pid, request = next(iter(self.waiting.items()))
        del self.waiting[pid]
        return self.processes.pop(pid), request

    def signal_all(self, sig: int) -> None:
        """Stop every standby (they are not replaced: each is marked as stopped on request)."""
        self.waiting.clear()
        for standby in self.processes.values():
            standby.stop_requested = True
            standby.signal(sig)

    def reap(self) -> list[tuple[Worker, int]]:
        exited = reap(self.processes)
        for standby, _ in exited:
            self.waiting.pop(standby.pid, None)
        return exited
