"""The agent's Prometheus metrics: its workers by state, and the seconds each commit of its snapshot writer took.

The agent's loop sets the states once a second (`WorkerStates.update`): the
thread serving metrics must not iterate the agent's dicts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import Gauge, Histogram

from elastic_control_plane.agent.intervals import INTERVALS

if TYPE_CHECKING:  # the keeper's snapshots (agent/snapshots.py) observe COMMIT_SECONDS: no import back at run time
    from elastic_control_plane.agent.keeper import WorkerKeeper

WORKER_STATES = ("running", "starting", "stopping", "standby", "restarting")
WORKERS_BY_STATE = Gauge(
    "elastic_agent_workers",
    "Worker processes of this host by state (set every second): running (entered a round), starting (started, not "
    "entered yet), stopping (signalled by the agent), standby (spare), restarting (crashed slot waiting out its "
    "back-off).",
    ["host", "state"],
)
COMMIT_SECONDS = Histogram(
    "elastic_commit_seconds",
    "Seconds the host's snapshot writer took to save a commit (copy and snapshot write), as it reports them.",
    ["host"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)


def worker_states(keeper: WorkerKeeper) -> list[str]:
    """The state of each of the keeper's processes (one of WORKER_STATES)."""
    states = [
        "stopping" if w.stop_requested else "running" if rank in keeper.book.entered else "starting"
        for rank, w in keeper.workers.items()
    ]
    return states + ["standby"] * len(keeper.standbys) + ["restarting"] * len(keeper.book.restarting())


class WorkerStates:
    """The host's gauge of the keeper's workers by state, set at most once every `metrics_every`."""

    def __init__(self, host: str, keeper: WorkerKeeper) -> None:
        self.host, self.keeper = host, keeper
        self.due = time.monotonic() + INTERVALS.metrics_every

    def update(self) -> None:
        now = time.monotonic()
        if now < self.due:
            return
        self.due = now + INTERVALS.metrics_every
        states = worker_states(self.keeper)
        for state in WORKER_STATES:
            WORKERS_BY_STATE.labels(self.host, state).set(states.count(state))
