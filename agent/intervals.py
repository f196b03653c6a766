"""The agent's own intervals, in one place, and the rules they keep with each other and with the control plane's
(bus/config.py `Timing`), checked when the agent starts (`check`), as the election's are (replication/election.py
`ElectionTiming`): a broken rule stops the agent with one line."""

from __future__ import annotations

from dataclasses import dataclass

from elastic_control_plane.bus.config import Timing

HANG_FLOOR_S = 30.0  # the registry's least hang limit (services/registry/hang_limits.py FLOOR_S)


@dataclass(frozen=True)
class AgentIntervals:
    tick: float = 0.05  # the loop's tick: restarts due, stops to escalate, the drain's end, the workers' waits
    stop_grace: float = 5.0  # a worker the agent stops gets SIGTERM, then SIGKILL this long after
    warm_up_limit: float = 120.0  # a joining host's workers get this long to be ready before the host counts anyway
    dump_grace: float = 1.0  # a worker asked for its stack gets this long to write it
    sample_after: float = 5.0  # a worker busy this long outside every collective has its process tree sampled...
    sample_every: float = 1.0  # ...this often
    partial_line_wait: float = 1.0  # a partial line of a worker's output is written after waiting this long
    parked_timeout: float = 5.0  # a round entry parked at the rendezvous is sent again after this long (same id)
    slot_report_deadline: float = 1.0  # the slots down, told to discovery
    exit_report_deadline: float = 300.0  # past it the registry is an outage the operator sees
    zygote_start_limit: float = 60.0  # a zygote still importing after this long is given up (workers are spawned)
    restart_backoff_first: float = 1.0  # the back-off before restarting a slot that crashed again...
    restart_backoff_cap: float = 30.0  # ...doubling up to this
    metrics_every: float = 1.0  # the workers' gauge is set at most this often

    def check(self, timing: Timing) -> AgentIntervals:
        """The rules; ValueError, one line, naming the first one broken."""
        rules = (
            (0 < self.tick < timing.heartbeat, f"the agent's tick ({self.tick:g} s) within a heartbeat"),
            (
                self.tick <= self.sample_every <= self.sample_after < HANG_FLOOR_S,
                "tick <= sample_every <= sample_after < the hang floor (30 s): a stall is seen before it is judged",
            ),
            (0 < self.dump_grace < self.stop_grace, "a stack dump's grace within a stop's"),
            (self.partial_line_wait >= self.tick, "a partial line waits a tick at least"),
            (0 < self.restart_backoff_first <= self.restart_backoff_cap, "0 < restart back-off <= its cap"),
            (
                self.exit_report_deadline > timing.request_timeout and self.parked_timeout > timing.request_timeout,
                f"exit reports and parked entries outlive a request's timeout ({timing.request_timeout:g} s)",
            ),
        )
        for kept, rule in rules:
            if not kept:
                raise ValueError(f"the agent's intervals break a rule: {rule}")
        return self


INTERVALS = AgentIntervals()
