"""Job: the registry's record of its job, the changes a job goes through, and the record's own way to be saved.

Every field of the job is declared once, on `Job`: its spec, number and key,
state and end, resets, the current round (its number, hosts and the host set's
timestamp it was made from), the round's reports (`ReportTable`), what the
driver knows of the hosts (agent incarnations, discovery's marks, the newest
snapshot commit each host's exit reports named), the commit it last resumed
from, its recent decisions, the waits its hang limit is calibrated by
(`wait_calibration`, services/registry/waits.py), and three instants of this
process's clock (since when it waits for slots, the round's first report, the
first failure not yet recovered from). `to_saved` and `from_saved` walk those fields:

- the spec is saved as its map and parsed again;
- an instant of this process's monotonic clock (a field marked `INSTANT`) is
  saved as wall-clock seconds to the millisecond, which mean the same to the
  next registry: `Now` is one reading of both clocks and converts between
  them (an unchanged instant saves the same, however the clocks jitter);
- what grows with the job's size is saved apart, and only when it changed
  (`unsaved_parts`, then `saved`): the round's hosts and their agents, with
  the report table's retired pids, in one part (`round`, written when a
  round begins); the reports in a part per host (`reports/<host>`, written
  when one of its slots changed; a host the round no longer has loses its
  part). The record itself is small: saving it when nothing changed writes
  nothing;
- a key that a saved map lacks (a field added since it was written) takes the
  field's default, so a record written by an earlier registry loads.

Each job has a random key, handed to the agents with every `round`: host
snapshots are tagged with it, so a snapshot of another job is never restored.
The job's goodput ledger (services/registry/ledger.py) is saved in parts of
its own (services/registry/ledger_record.py: `ledger`, at each transition, and
within seconds of progress or during an interruption, so a registry started
again knows how long it was down; `ledger_timeline`, when an interruption
ends). The newest commit in a live host's snapshot (from the agents'
heartbeats, via discovery, and from their exit reports: `snapshot_commits`)
lets a job whose every worker failed resume from it (`resumed_from`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.registry import ledger_record
from elastic_control_plane.services.registry.decisions import Decision
from elastic_control_plane.services.registry.goodput import failure_cause, fault_instant
from elastic_control_plane.services.registry.ledger import Ledger
from elastic_control_plane.services.registry.reports import FAILURE, PENDING, ReportTable

NO_JOB, WAITING, RUNNING_JOB, SUCCEEDED, FAILED = "none", "waiting", "running", "succeeded", "failed"
JOB_STATES = (NO_JOB, WAITING, RUNNING_JOB, SUCCEEDED, FAILED)
HISTORY_KEPT = 100  # decisions kept with the job (status shows the last 20): bounded however many resets
INSTANT = {"clock": "monotonic"}  # the metadata of a field that holds an instant of this process's clock
ROUND_PART = "round"  # the part that holds ROUND_FIELDS and the report table's retired pids
ROUND_FIELDS = ("round_hosts", "agents")
REPORTS_PART = "reports/"  # + a host: the part that holds that host's reports
LEDGER_PART = "ledger"  # the goodput ledger (services/registry/ledger.py), saved when it changed or is due
TIMELINE_PART = "ledger_timeline"  # its interruptions, saved when one ends


@dataclass(frozen=True)
class Now:
    """One reading of this process's monotonic clock (`local`) and of the wall clock (`wall`)."""

    local: float
    wall: float

    @classmethod
    def read(cls, clock: Callable[[], float]) -> Now:
        return cls(clock(), time.time())

    def as_wall(self, instant: float | None) -> float | None:
        return None if instant is None else self.wall - (self.local - instant)

    def as_local(self, wall: float | None) -> float | None:
        return None if wall is None else self.local - (self.wall - wall)


@dataclass
class Job:
    spec: JobSpec | None = None
    job_id: int = 0
    job_key: str = ""  # handed to the agents with every round: a host's snapshot of another job is never restored
    run_id: str = ""  # the name its submitter gave it (elasticctl run --attach): a new submitter of it follows it
    state: str = NO_JOB
    exit_code: int | None = None
    reason: str = ""
    resets: int = 0
    failure_resets: int = 0  # the resets after a round with a failure (torchrun mode's reset limit counts these)
    round: int = 0
    round_hosts: list[list[Any]] = field(default_factory=list)  # [[host, [slot ids]]] in rank order (job.assignments)
    round_hosts_timestamp: float = 0.0
    reports: ReportTable = field(default_factory=ReportTable)
    agents: dict[str, str] = field(default_factory=dict)  # host: its agent's incarnation when the round began
    host_marks: dict[str, dict[str, Any]] = field(default_factory=dict)  # drains and blacklists (hosts.host_marks)
    snapshot_commits: dict[str, int] = field(default_factory=dict)  # host: the newest commit its exit reports named
    resumed_from: int = 0  # the commit the job last resumed from after every worker failed (0: never)
    history: list[dict[str, Any]] = field(default_factory=list)
    wait_calibration: dict[str, float] = field(default_factory=dict)  # the longest wait, typical busy time reported
    # "host:local_rank": [times its hang limits doubled, the pid whose kill doubled them last] (registry/waits.py)
    hang_doublings: dict[str, list[int]] = field(default_factory=dict)
    waiting_since: float = field(default=0.0, metadata=INSTANT)
    first_report_at: float | None = field(default=None, metadata=INSTANT)
    failure_seen_at: float | None = field(default=None, metadata=INSTANT)
    ledger: Ledger = field(default_factory=Ledger, compare=False)  # where the job's wall clock went

    def __post_init__(self) -> None:
        self._round_unsaved = True  # the round part changed since it was last saved
        self._ledger_saving_at = 0.0  # the instant of the ledger part `unsaved_parts` last gave

    @classmethod
    def submitted(cls, spec: JobSpec, job_id: int, now: float, run_id: str = "") -> Job:
        job_key = uuid.uuid4().hex[:16]
        ledger = Ledger(now, spec.max_np)
        return cls(
            spec=spec, job_id=job_id, job_key=job_key, run_id=run_id, state=WAITING, waiting_since=now, ledger=ledger
        )

    @property
    def active(self) -> bool:
        return self.state in (WAITING, RUNNING_JOB)

    def summary(self) -> dict[str, Any]:
        """The registry's answer to `job`."""
        return {
            "job": self.job_id,
            "state": self.state,
            "round": self.round,
            "size": len(self.reports),
            "resets": self.resets,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "spec": self.spec.to_dict() if self.spec else None,
            "job_key": self.job_key,
            "run_id": self.run_id,
            "resumed_from": self.resumed_from,
        }

    def restored_round(self) -> dict[str, Any]:
        """What a restarted rendezvous is given back (`restore_round`): the current round, whether it was released
        (no slot still waits for its rank) and the pids of the workers that have theirs."""
        return {
            "round": self.round,
            "hosts": self.round_hosts,
            "hosts_timestamp": self.round_hosts_timestamp,
            "released": self.reports.count(PENDING) == 0,
            "pids": self.reports.started_pids(),
        }

    # -- what happens to a job -----------------------------------------------------------------
    def begin_round(
        self, number: int, hosts: list[list[Any]], hosts_timestamp: float, agents: dict[str, str], replacing: bool
    ) -> None:
        """Round `number` on `hosts` began; it counts as a reset unless it is the first or it replaces one that was
        still forming."""
        if self.round >= 1 and not replacing:
            self.resets += 1
        self.round, self.round_hosts, self.round_hosts_timestamp = number, hosts, hosts_timestamp
        self.agents = agents
        # What the job keeps per host is kept for live hosts only (the round's and the live agents'): hosts come and
        # go by new names for weeks.
        live = agents.keys() | {host for host, _ in hosts}
        self.snapshot_commits = {host: c for host, c in self.snapshot_commits.items() if host in live}
        self.hang_doublings = {slot: d for slot, d in self.hang_doublings.items() if slot.rpartition(":")[0] in live}
        self._round_unsaved = True
        # The ranks of the round's slots, as job.assignments gives them: one per slot, in the order of `hosts`.
        slots = ((host, local_rank) for host, local_ranks in hosts for local_rank in local_ranks)
        self.reports.begin_round((slot, rank) for rank, slot in enumerate(slots))
        self.first_report_at = None
        self.state = RUNNING_JOB

    def wait_for_next_round(self, now: float) -> None:
        """The round is reset: the job waits for the next; a reset after a round with a failure counts as one."""
        self.state, self.waiting_since = WAITING, now
        self.failure_resets += self.reports.count(FAILURE) > 0

    def resets_toward_limit(self, torchrun: bool) -> int:
        """The resets the reset limit counts: all of them, or in torchrun mode those after a failure."""
        return self.failure_resets if torchrun else self.resets

    def finish(self, state: str, reason: str, exit_code: int, now: float) -> None:
        self.state, self.reason, self.exit_code = state, reason, exit_code
        self.ledger.ended(now)

    def note_report(self, now: float) -> None:
        """A slot reported: the hung timeout runs from the round's first report."""
        if self.first_report_at is None:
            self.first_report_at = now

    def note_failure(
        self, now: float, host: str = "", reason: str = "", lost_after: float = 0.0, stalled_s: float | None = None
    ) -> None:
        """The round's first failure (on `host`, why): the recovery time runs from the first failure not yet
        recovered from; the ledger's interruption from when it began (goodput.fault_instant)."""
        if self.failure_seen_at is None:
            self.failure_seen_at = now
        cause = failure_cause(reason)
        self.ledger.fault(now, fault_instant(cause, now, lost_after, stalled_s), cause, host, reason)

    def recovered(self, now: float) -> float | None:
        """A round was released: the seconds since the failure it recovers from (None: none), now forgotten."""
        seconds = None if self.failure_seen_at is None else now - self.failure_seen_at
        self.failure_seen_at = None
        return seconds

    def note_snapshot_commit(self, host: str, commit: int) -> None:
        self.snapshot_commits[host] = max(commit, self.snapshot_commits.get(host, 0))

    def note_decision(self, decision: Decision, now: float) -> None:
        if decision.action == "resume":
            self.ledger.decided(now, restart=bool(decision.resume_from))
        self.history = [
            *self.history[-(HISTORY_KEPT - 1) :],
            {"round": self.round, "action": decision.action, "reason": decision.reason},
        ]

    # -- saving --------------------------------------------------------------------------------
    def to_saved(self, now: Now) -> dict[str, Any]:
        """The record as the map the registry saves (its round and reports apart: `unsaved_parts`)."""
        apart = ("reports", "ledger", *ROUND_FIELDS)
        saved: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in apart}
        saved["spec"] = self.spec.to_dict() if self.spec else None
        for name in INSTANTS:
            wall = now.as_wall(saved[name])
            saved[name] = None if wall is None else round(wall, 3)
        return saved

    def unsaved_parts(self, now: Now) -> dict[str, str | None]:
        """The parts saved apart that changed since `saved` was last called (the ledger: or is due at `now`), as JSON
        (None: a part to delete)."""
        parts: dict[str, str | None] = {REPORTS_PART + host: row for host, row in self.reports.unsaved_rows().items()}
        if self.ledger.due(now.local):
            self._ledger_saving_at = now.local
            parts[LEDGER_PART] = json.dumps(ledger_record.to_saved(self.ledger, now.local, now.as_wall))
            if self.ledger.timeline_changed:
                parts[TIMELINE_PART] = json.dumps(ledger_record.timeline_to_saved(self.ledger, now.as_wall))
        if self._round_unsaved:
            apart = {name: getattr(self, name) for name in ROUND_FIELDS}
            parts[ROUND_PART] = json.dumps({**apart, "retired_pids": list(self.reports.retired_pids)})
        return parts

    def saved(self, parts: dict[str, str | None]) -> None:
        """`parts`, as `unsaved_parts` gave them, are saved."""
        self.reports.saved(
            {key[len(REPORTS_PART) :]: row for key, row in parts.items() if key.startswith(REPORTS_PART)}
        )
        if ROUND_PART in parts:
            self._round_unsaved = False
        if LEDGER_PART in parts:
            self.ledger.saved(self._ledger_saving_at, timeline=TIMELINE_PART in parts)

    @classmethod
    def from_saved(cls, saved: dict[str, Any], parts: dict[str, Any], now: Now) -> Job:
        """The record `to_saved` made, with the parts saved apart (key: parsed JSON; none for a job that had no
        round yet)."""
        values = {f.name: saved[f.name] for f in fields(cls) if f.name in saved}
        values["spec"] = JobSpec.parse(saved["spec"]) if saved.get("spec") else None
        values.update({name: now.as_local(values[name]) for name in INSTANTS if name in values})
        apart = parts.get(ROUND_PART) or {}
        values.update({name: apart[name] for name in ROUND_FIELDS if name in apart})
        rows = {key[len(REPORTS_PART) :]: row for key, row in parts.items() if key.startswith(REPORTS_PART)}
        values["reports"] = ReportTable.from_saved(rows, apart.get("retired_pids", []))
        ledger = parts.get(LEDGER_PART), parts.get(TIMELINE_PART)
        values["ledger"] = ledger_record.from_saved(*ledger, now.local, now.as_local)
        job = cls(**values)
        job._round_unsaved = ROUND_PART not in parts
        return job


INSTANTS = tuple(f.name for f in fields(Job) if f.metadata == INSTANT)
