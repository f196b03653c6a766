"""ExitReports: what the agent tells the control plane when one of its workers exits.

The registry hears of every exit at once (with the host's newest snapshot
commit, and the verdict: restarting in place, given up, died after its script
ended; for a worker killed as hung, why and its stack: `Worker.hang`), and again,
with a backoff, while it answers that it could not save it (`unavailable`: its
store refused or is out of reach), until it has or the report's deadline
passes; the rendezvous forgets the worker's round entry, except where the slot's
process lives on (a torchrun-mode slot whose command failed: its supervisor
enters the next round).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.snapshots import SnapshotKeeper
from elastic_control_plane.bus.client import AsyncClient
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.bus.envelope import Message


class ExitReports:
    def __init__(
        self,
        host: str,
        timing: Timing,
        registry: AsyncClient,
        rendezvous: AsyncClient,
        snapshots: SnapshotKeeper,
        log: Any,
    ) -> None:
        self.host, self.timing, self.log = host, timing, log
        self.registry, self.rendezvous, self.snapshots = registry, rendezvous, snapshots

    def worker_exited(
        self,
        local_rank: int,
        pid: int,
        code: int,
        then: Callable[[], None] | None = None,
        process_lives: bool = False,
        **verdict: Any,
    ) -> None:
        """Tell the registry a worker exited; `then` runs once the registry has saved it (or could not be reached).
        `process_lives`: a torchrun-mode slot's command failed and its supervisor, the slot's process, enters the next
        round (the rendezvous keeps its entry)."""
        slot = {"host": self.host, "local_rank": local_rank, "pid": pid}
        newest = self.snapshots.newest()
        verdict["snapshot_commit"] = newest.commit if newest is not None else 0
        said = {"refused": False}

        def say_once(refusal: Message) -> None:
            if not said["refused"]:
                said["refused"] = True
                self.log.warning("exit_report_delayed", pid=pid, reason=refusal.body.get("message", refusal.error))

        self.registry.send(
            "worker_exited",
            {**slot, "exit_code": code, **verdict},
            on_reply=lambda _: then and then(),
            on_timeout=then,
            timeout=self.timing.request_timeout,
            deadline=INTERVALS.exit_report_deadline,
            retry_refused=say_once,
        )
        if not process_lives:
            self.rendezvous.send("forget", slot, timeout=self.timing.request_timeout, deadline=60.0)
