"""RegistryService: holds the job and drives it (Horovod's ElasticDriver and WorkerStateRegistry).

Messages:
  submit {spec}                       -> {job}        a new job (refused while one runs)
  job                                 -> {state, round, size, resets, exit_code, reason}
  status                              -> job + every worker of the current round
  cancel {reason}                     stop the job (elasticctl run interrupted)
  worker_exited {host, local_rank, pid, exit_code, restarting, gave_up, after_script_end, snapshot_commit}   from agents:
                                      `restarting` means the agent restarts the slot in place (the host stays);
                                      `gave_up` is the reason it stopped restarting a crash-looping slot (the host
                                      is blacklisted); `after_script_end`: killed by a signal after its script
                                      ended (a crash in teardown: the worker's work is done, it counts as
                                      finished); `snapshot_commit` the commit in the host's snapshot

On every tick the driver reads the host set (discovery) and the rounds
(rendezvous): it starts a round when enough slots exist, records READY /
RUNNING / FAILURE from what it reads, and once every slot of the round has
reported, applies `decisions.decide`. A round still forming (no worker has its
rank yet) when the host set changes (a drain, a host lost or added) is replaced
at once by a round on the hosts as they are now, instead of forming, training
and resetting. Events go to agents through the notifier:
`round`, `abort`, `kill_worker`, `job_finished`.

Each job has a random key, handed to the agents with every `round`: host
snapshots are tagged with it, so a snapshot of another job is never restored.
The newest commit in a live host's snapshot (from the agents' heartbeats, via
discovery, and from their exit reports) lets a job whose every worker failed
resume from it.

Durable. The registry keeps the job in a SQLite database under `--state-dir`
(services/registry/store.py), saved after every change and before it
answers or publishes what the change caused; events wait in an outbox (saved
with the job) until the notifier takes them. A registry killed and started
again carries on with the same job, round and resets. The other services keep
nothing on disk, and the registry rebuilds them from what it saved and what it
reads: a discovery with a new incarnation is told the job's settings, the
drains and blacklists it had, and the hosts of the current round
(`restore`); a rendezvous behind the job's round is given that round back
(`restore_round`). While a restarted discovery is still hearing from the
agents (`settling`), the driver neither starts rounds nor judges hosts.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from bus.assignments import get_host_assignments
from bus.client import Client, ServiceError, Unreachable, incarnation_id
from bus.config import Endpoints, Timing
from bus.outbox import Outbox
from bus.service import Request, RequestError, Service, field, handles
from services.registry import metrics
from services.registry.decisions import (
    FAILURE,
    PENDING,
    READY,
    REPORTED,
    RUNNING,
    SUCCESS,
    Slot,
    SlotReport,
    Decision,
    barrier_complete,
    decide,
)
from services.registry.jobspec import JobSpec
from services.registry.store import JobStore

HISTORY_KEPT = 100  # decisions kept with the job (status shows the last 20): bounded however many resets
RETIRED_PIDS_KEPT = 4096  # pids of earlier rounds' workers, to tell a leftover's exit from a current worker's

NO_JOB, WAITING, RUNNING_JOB, SUCCEEDED, FAILED = "none", "waiting", "running", "succeeded", "failed"


class RegistryService(Service):
    name = "registry"

    def __init__(self, endpoint: str, peers: Endpoints, timing: Timing, state_dir: Path, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self.timing = timing
        sender = incarnation_id(self.name)

        def client(address: str) -> Client:
            return Client(address, sender, security=self.security, ctx=self.ctx, timeout=0.5, deadline=1.0)

        self.discovery, self.rendezvous = client(peers.discovery), client(peers.rendezvous)
        self.store = JobStore(state_dir)
        saved = self.store.load(parts=("reports",))
        self._reports_saved: tuple[tuple[int, int, int], str] = ((0, 0, -1), "[]")
        self.outbox = Outbox(self, peers.notifier, sender, self.security, ((e, d) for e, d in (saved or {}).get("outbox", [])))
        self.last_job_id = 0
        self.discovery_incarnation: str | None = None
        self._new_job(None)
        if saved is not None:
            self._load(saved)
        metrics.job_state(self.state)
        self.outbox.flush()
        self.every(timing.driver_tick, self._tick)

    def _new_job(self, spec: JobSpec | None) -> None:
        self.spec = spec
        if spec:
            self.last_job_id += 1
        self.job_id = self.last_job_id if spec else 0
        self.job_key = uuid.uuid4().hex[:16] if spec else ""
        self.snapshot_commits: dict[str, int] = {}
        self.resumed_from = 0
        self.state = WAITING if spec else NO_JOB
        self.exit_code: int | None = None
        self.reason = ""
        self.resets = 0
        self.round = 0
        self.round_hosts: list[list[Any]] = []  # [[host, [slot ids]]] in rank order (bus.assignments)
        self.round_hosts_timestamp = 0.0
        self.reports: dict[Slot, SlotReport] = {}
        self.retired_pids: dict[int, None] = {}
        self.agents: dict[str, str] = {}
        self.host_marks: dict[str, dict[str, Any]] = {}
        self.waiting_since = self.clock()
        self.first_report_at: float | None = None
        self.failure_seen_at: float | None = None
        self.history: list[dict[str, Any]] = []

    # -- durability ----------------------------------------------------------------------------
    def _wall(self, instant: float | None) -> float | None:
        """A time of this process's clock as wall-clock seconds, which mean the same to the next registry."""
        return None if instant is None else time.time() - (self.clock() - instant)

    def _local(self, wall: float | None) -> float | None:
        return None if wall is None else self.clock() - (time.time() - wall)

    def _saved_state(self) -> dict[str, Any]:
        return {
            "last_job_id": self.last_job_id, "discovery_incarnation": self.discovery_incarnation,
            "outbox": [list(event) for event in self.outbox.queued],
            "job": {
                "spec": self.spec.to_dict() if self.spec else None, "job_id": self.job_id, "job_key": self.job_key,
                "snapshot_commits": self.snapshot_commits, "resumed_from": self.resumed_from, "state": self.state,
                "exit_code": self.exit_code, "reason": self.reason, "resets": self.resets, "round": self.round,
                "round_hosts": self.round_hosts, "round_hosts_timestamp": self.round_hosts_timestamp,
                "retired_pids": list(self.retired_pids), "agents": self.agents, "host_marks": self.host_marks,
                "waiting_since": self._wall(self.waiting_since), "first_report_at": self._wall(self.first_report_at),
                "failure_seen_at": self._wall(self.failure_seen_at), "history": self.history,
            },
        }

    def _load(self, saved: dict[str, Any]) -> None:
        job = saved["job"]
        self.last_job_id, self.discovery_incarnation = saved["last_job_id"], saved["discovery_incarnation"]
        self.spec = JobSpec.parse(job["spec"]) if job["spec"] else None
        for name in ("job_id", "job_key", "snapshot_commits", "resumed_from", "state", "exit_code", "reason", "resets", "round",
                     "round_hosts", "round_hosts_timestamp", "agents", "host_marks", "history"):
            setattr(self, name, job[name])
        self.reports = {(r.pop("host"), r.pop("local_rank")): SlotReport(**r) for r in saved.get("reports") or []}
        self.retired_pids = dict.fromkeys(job["retired_pids"])
        self.waiting_since = self._local(job["waiting_since"]) or self.clock()
        self.first_report_at, self.failure_seen_at = self._local(job["first_report_at"]), self._local(job["failure_seen_at"])
        self.log.info("job_recovered", job=self.job_id, state=self.state, round=self.round, resets=self.resets, store=str(self.store.path))

    def _commit(self) -> None:
        """Save what changed, then send the events it caused: nothing goes out that a restart could forget."""
        self.store.save(self._saved_state(), {"reports": self._reports_text()})
        self.outbox.flush()

    def _reports_text(self) -> str:
        """The reports as JSON, serialized again only when the reports were replaced or one of them changed: not
        32,768 of them on every tick."""
        version = (id(self.reports), len(self.reports), SlotReport.changes)
        if version != self._reports_saved[0]:
            text = json.dumps([{"host": slot[0], "local_rank": slot[1], **vars(r)} for slot, r in self.reports.items()], separators=(",", ":"))
            self._reports_saved = (version, text)
        return self._reports_saved[1]

    # -- requests ------------------------------------------------------------------------------
    @handles("submit")
    def on_submit(self, request: Request) -> dict[str, Any]:
        if self.state in (WAITING, RUNNING_JOB):
            raise RequestError("job_running", f"job {self.job_id} is still {self.state}; one job at a time")
        spec = JobSpec.parse(request.body.get("spec"))
        try:
            self.rendezvous.request("reset")
            configured = self.discovery.request("configure", self._discovery_settings(spec)).body
        except (Unreachable, ServiceError) as exc:
            raise RequestError("unavailable", f"cannot prepare the job: {exc}") from None
        self._new_job(spec)
        self.discovery_incarnation = configured.get("incarnation")
        metrics.job_state(self.state)
        self.log.info("job_submitted", job=self.job_id, command=spec.command, min_np=spec.min_np, max_np=spec.max_np)
        self._commit()
        return {"job": self.job_id}

    @staticmethod
    def _discovery_settings(spec: JobSpec) -> dict[str, Any]:
        return {"max_np": spec.max_np, "discovery_script": spec.discovery_script, "cooldown": list(spec.cooldown) if spec.cooldown else None}

    @handles("cancel")
    def on_cancel(self, request: Request) -> dict[str, Any]:
        if self.state in (WAITING, RUNNING_JOB):
            self._finish(FAILED, str(request.body.get("reason") or "cancelled"), 130)
            self._commit()
        return self._job_summary()

    @handles("job")
    def on_job(self, request: Request) -> dict[str, Any]:
        return self._job_summary()

    @handles("status")
    def on_status(self, request: Request) -> dict[str, Any]:
        workers = [
            {"host": slot[0], "local_rank": slot[1], "rank": r.rank, "state": r.state, "pid": r.pid, "exit_code": r.exit_code, "reason": r.reason}
            for slot, r in sorted(self.reports.items(), key=lambda kv: kv[1].rank)
        ]
        return {**self._job_summary(), "workers": workers, "history": self.history[-20:]}

    @handles("worker_exited")
    def on_worker_exited(self, request: Request) -> dict[str, Any]:
        body = request.body
        slot = (field(body, "host", str), field(body, "local_rank", int))
        pid, code = field(body, "pid", int), body.get("exit_code")
        snapshot_commit = body.get("snapshot_commit")
        if isinstance(snapshot_commit, int) and not isinstance(snapshot_commit, bool) and snapshot_commit > 0:
            self.snapshot_commits[slot[0]] = max(snapshot_commit, self.snapshot_commits.get(slot[0], 0))
        restarting, gave_up = body.get("restarting") is True, body.get("gave_up")
        gave_up = gave_up if isinstance(gave_up, str) and gave_up else None
        if self.state in (SUCCEEDED, FAILED):
            self.log.info("worker_exited_after_job_end", host=slot[0], local_rank=slot[1], pid=pid, exit_code=code)
            self._commit()
            return {"recorded": False}
        report = self.reports.get(slot)
        if report is None or not self._belongs_to_round(report, pid):
            self.log.info("worker_left", host=slot[0], local_rank=slot[1], pid=pid, exit_code=code)
            if gave_up and self.state in (WAITING, RUNNING_JOB):
                self._blacklist(slot[0], f"slot {slot[1]} {gave_up}")
            self._commit()
            return {"recorded": False}
        report.pid, report.exit_code = pid, code
        if code == 0:
            report.state, report.reason = SUCCESS, "exited with code 0"
        elif body.get("after_script_end") is True and isinstance(code, int) and code < 0:
            report.state, report.reason = SUCCESS, f"its script ended, then it died of signal {-code} in interpreter teardown"
            self.log.warning("worker_died_after_its_script_ended", host=slot[0], local_rank=slot[1], rank=report.rank, pid=pid, exit_code=code)
        else:
            report.host_stays = restarting and not gave_up
            why = f"; {gave_up}" if gave_up else "; restarting in place" if report.host_stays else ""
            self._fail_slot(slot, f"exited with code {code}{why}")
        self._note_report()
        self.log.info("worker_exited", host=slot[0], local_rank=slot[1], rank=report.rank, pid=pid, exit_code=code, round=self.round)
        self._commit()
        return {"recorded": True}

    def _belongs_to_round(self, report: SlotReport, pid: int) -> bool:
        """Is this exiting process the current round's worker of its slot? A process that was a worker of an
        earlier round and did not re-join this one is a leftover; one that never joined would have joined this one."""
        if report.state in (SUCCESS, FAILURE):
            return False
        if report.pid is not None:
            return report.pid == pid
        return pid not in self.retired_pids

    def _job_summary(self) -> dict[str, Any]:
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
            "resumed_from": self.resumed_from,
        }

    # -- the driver ----------------------------------------------------------------------------
    def _tick(self) -> None:
        if self.state not in (WAITING, RUNNING_JOB):
            return
        try:
            hosts = self.discovery.request("hosts", {"brief": True}).body
            pending = self.state == RUNNING_JOB and any(r.state == PENDING for r in self.reports.values())
            rounds = self.rendezvous.request("status", {"parked_after": self.round, "pids": pending}).body
            if not self._reconciled(hosts, rounds):
                return
        except (Unreachable, ServiceError) as exc:
            self.log.warning("driver_blind", reason=str(exc))
            return
        if self.state == WAITING:
            self._start_round(hosts)
        elif self.state == RUNNING_JOB:
            self._observe(hosts, rounds)
        metrics.workers(r.state for r in self.reports.values())
        self._commit()

    def _reconciled(self, hosts: dict[str, Any], rounds: dict[str, Any]) -> bool:
        """Give a restarted discovery or rendezvous back what the job had; True when both agree with the job and
        discovery has heard from its agents (the driver may judge hosts and start rounds)."""
        assert self.spec is not None
        if hosts.get("incarnation") != self.discovery_incarnation:
            expected = self.round_hosts
            self.discovery.request("restore", {**self._discovery_settings(self.spec), "marks": self.host_marks, "expected": expected})
            self.discovery_incarnation = hosts.get("incarnation")
            self.log.info("discovery_restored", incarnation=self.discovery_incarnation, marks=sorted(self.host_marks), expected=[h for h, _ in expected])
            return False
        if rounds.get("round", 0) < self.round and self.round_hosts:
            pids = [[slot[0], slot[1], r.pid] for slot, r in self.reports.items() if r.pid is not None and r.state != PENDING]
            released = all(r.state != PENDING for r in self.reports.values())
            self.rendezvous.request(
                "restore_round",
                {"round": self.round, "hosts": self.round_hosts, "hosts_timestamp": self.round_hosts_timestamp, "released": released, "pids": pids},
            )
            self.log.info("rendezvous_restored", round=self.round, released=released)
            return False
        if hosts.get("settling"):
            return False
        self.host_marks = self._host_marks(hosts)
        return True

    def _host_marks(self, hosts: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """What discovery holds against hosts (drains, blacklists with their count and end), to give a restarted
        discovery; a blacklist already recorded keeps its end, so an unchanged one is not saved again."""
        marks = {}
        for row in hosts.get("marked", []):
            known = self.host_marks.get(row["host"], {})
            until = None
            if row.get("blacklisted") and row.get("cooldown_left") is not None:
                same = known.get("blacklisted") and known.get("count") == row.get("blacklist_count") and known.get("until") is not None
                until = known["until"] if same else round(time.time() + row["cooldown_left"], 3)
            marks[row["host"]] = {
                "draining": bool(row.get("draining")), "blacklisted": bool(row.get("blacklisted")), "until": until,
                "count": int(row.get("blacklist_count") or 0), "reason": str(row.get("blacklist_reason") or ""),
            }
        return marks

    def _observe(self, hosts: dict[str, Any], rounds: dict[str, Any]) -> None:
        if rounds.get("round") == self.round and not rounds.get("released") and hosts.get("timestamp") != self.round_hosts_timestamp:
            if self._start_round(hosts, replacing=True):
                return
        lost = set(hosts.get("lost", []))
        agents = self._agent_incarnations(hosts)
        restarted = {host for host, incarnation in agents.items() if incarnation != self.agents.get(host)}
        for host, local_ranks in self.round_hosts:
            if host not in lost and host not in restarted:
                continue
            for slot in ((host, local_rank) for local_rank in local_ranks):
                report = self.reports[slot]
                if report.state in REPORTED:
                    continue
                if host in lost:
                    self._fail_slot(slot, "host lost (missed heartbeats)")
                else:
                    report.host_stays = True
                    self._fail_slot(slot, "its agent restarted (the workers died with the old one)")
        if rounds.get("round") == self.round and rounds.get("released"):
            if self.failure_seen_at is not None:
                metrics.recovered(self.clock() - self.failure_seen_at)
                self.failure_seen_at = None
            for host, local_rank, pid in rounds.get("pids", []):
                started = self.reports.get((host, local_rank))
                if started is not None and started.state == PENDING:
                    started.state, started.pid = RUNNING, pid
        for join in rounds.get("parked", []):
            rejoined = self.reports.get((join["host"], join["local_rank"]))
            if rejoined is not None and join["after_round"] >= self.round and rejoined.state in (PENDING, RUNNING):
                rejoined.state, rejoined.pid = READY, join["pid"]
                self._note_report()
        self._check_hung()
        if barrier_complete(self.reports):
            try:
                newest = self._newest_snapshot(self.discovery.request("hosts").body)
            except (Unreachable, ServiceError) as exc:
                self.log.warning("driver_blind", reason=str(exc))
                return
            self._apply(decide(self.reports, self.resets, self.spec.reset_limit if self.spec else None, newest, self.resumed_from))

    def _newest_snapshot(self, hosts: dict[str, Any]) -> int:
        """The newest commit held in a snapshot that an agent keeps now: a host that is not lost and whose agent
        reports one (an agent that restarted starts with an empty snapshot). Its exit reports may be newer than
        its last heartbeat."""
        newest = 0
        for host in hosts.get("all", []):
            snapshot = host.get("snapshot") or {}
            if host.get("state") != "lost" and isinstance(snapshot.get("commit"), int) and snapshot["commit"] > 0:
                newest = max(newest, snapshot["commit"], self.snapshot_commits.get(host["host"], 0))
        return newest

    @staticmethod
    def _agent_incarnations(hosts: dict[str, Any]) -> dict[str, str]:
        agents = hosts.get("agents", {})
        return {host: incarnation for host, incarnation in agents.items() if isinstance(incarnation, str)}

    def _fail_slot(self, slot: Slot, reason: str) -> None:
        report = self.reports[slot]
        first = not any(r.state == FAILURE for r in self.reports.values())
        report.state, report.reason = FAILURE, reason
        report.failed_order = sum(r.state == FAILURE for r in self.reports.values())
        self._note_report()
        self.log.warning("worker_failed", host=slot[0], local_rank=slot[1], rank=report.rank, reason=reason, round=self.round)
        if first:
            if self.failure_seen_at is None:
                self.failure_seen_at = self.clock()
            self._publish("abort", {"round": self.round})

    def _note_report(self) -> None:
        if self.first_report_at is None:
            self.first_report_at = self.clock()

    def _check_hung(self) -> None:
        """Slots silent `hung_timeout` after the round's first report: after a success the job is done and the rest
        are stopped; otherwise they count as failed (hung) and their agents kill them."""
        assert self.spec is not None
        if self.first_report_at is None or self.clock() - self.first_report_at < self.spec.hung_timeout:
            return
        if any(r.state == SUCCESS for r in self.reports.values()):
            silent = sum(r.state not in REPORTED for r in self.reports.values())
            self._apply(Decision("succeed", f"job finished ({silent} worker(s) still running were stopped)"))
            return
        for slot, report in self.reports.items():
            if report.state not in REPORTED:
                self._fail_slot(slot, f"hung: no report {self.spec.hung_timeout:g}s after the round's first")
                self._publish("kill_worker", {"host": slot[0], "local_rank": slot[1], "pid": report.pid})

    def _apply(self, decision: Decision) -> None:
        self.history = [*self.history[-(HISTORY_KEPT - 1):], {"round": self.round, "action": decision.action, "reason": decision.reason}]
        if decision.action == "succeed":
            self._finish(SUCCEEDED, decision.reason, 0)
            return
        if decision.action == "fail":
            self._finish(FAILED, decision.reason, decision.exit_code)
            return
        for host in decision.blacklist:
            what = "; ".join(r.describe(slot) for slot, r in self.reports.items() if slot[0] == host and r.state == FAILURE)
            self._blacklist(host, f"round {self.round}: {what}")
        if decision.resume_from:
            self.resumed_from = decision.resume_from
        self.log.info("round_reset", round=self.round, reason=decision.reason or "hosts changed")
        metrics.reset(self._reset_cause(decision))
        self.state = WAITING
        metrics.job_state(self.state)
        self.waiting_since = self.clock()
        if decision.blacklist:
            self._fail_if_all_blacklisted(decision.reason)

    def _reset_cause(self, decision: Decision) -> str:
        if decision.resume_from:
            return "resume"
        reasons = [r.reason for r in self.reports.values() if r.state == FAILURE]
        if not reasons:
            return "hosts_changed"
        if any(reason.startswith("host lost") for reason in reasons):
            return "host_lost"
        if any(reason.startswith("its agent restarted") for reason in reasons):
            return "agent_restarted"
        return "worker_failed"

    def _blacklist(self, host: str, reason: str) -> None:
        try:
            self.discovery.request("blacklist", {"host": host, "reason": reason})
        except (Unreachable, ServiceError) as exc:
            self.log.warning("blacklist_failed", host=host, reason=str(exc))

    def _fail_if_all_blacklisted(self, reason: str) -> None:
        try:
            hosts = self.discovery.request("hosts").body
        except (Unreachable, ServiceError):
            return
        usable = [h for h in hosts["all"] if h["state"] != "lost" and not h["blacklisted"]]
        if not usable:
            self._finish(FAILED, f"every host is blacklisted ({reason})", 1)

    def _start_round(self, hosts: dict[str, Any], replacing: bool = False) -> bool:
        """Start a round on the available hosts; True when it started. `replacing`: the current round is still
        forming (no worker has its rank) and the hosts changed since it began: a new round on the hosts as they
        are now replaces it at once, instead of waiting for it to form, train and reset (not counted as a reset)."""
        assert self.spec is not None
        available = hosts.get("available", [])
        total = sum(len(slots) if isinstance(slots, list) else slots for _, slots in available)
        if replacing and total < self.spec.min_np:
            return False
        if total < self.spec.min_np:
            waited = self.clock() - self.waiting_since
            if waited > self.spec.elastic_timeout:
                self._finish(
                    FAILED,
                    f"timed out after {self.spec.elastic_timeout:g}s waiting for {self.spec.min_np} slot(s); {total} available",
                    1,
                )
            return False
        if not replacing and self.round >= 1 and self.spec.reset_limit is not None and self.resets >= self.spec.reset_limit:
            self._finish(FAILED, f"reset limit {self.spec.reset_limit} reached", 1)
            return False
        try:
            reply = self.rendezvous.request(
                "new_round",
                {
                    "hosts": available, "min_np": self.spec.min_np, "max_np": self.spec.max_np, "hosts_timestamp": hosts["timestamp"],
                    "replaces": self.round if replacing else None, "round": self.round + 1,
                },
            ).body
        except ServiceError as exc:
            if exc.code == "no_surviving_host":
                self._finish(FAILED, exc.message, 1)
            elif exc.code != "released":
                self.log.warning("round_refused", code=exc.code, reason=exc.message)
            return False
        except Unreachable as exc:
            self.log.warning("driver_blind", reason=str(exc))
            return False
        if self.round >= 1 and not replacing:
            self.resets += 1
        survivors = {slot: r.pid for slot, r in self.reports.items() if r.state == READY}
        self.retired_pids.update(dict.fromkeys(r.pid for r in self.reports.values() if r.pid is not None and r.state != READY))
        for pid in list(self.retired_pids)[: max(0, len(self.retired_pids) - RETIRED_PIDS_KEPT)]:
            del self.retired_pids[pid]
        self.round = reply["round"]
        self.round_hosts, self.round_hosts_timestamp = reply["hosts"], reply["hosts_timestamp"]
        metrics.round_started()
        self.agents = self._agent_incarnations(hosts)
        self.reports = {
            (s.hostname, s.local_rank): SlotReport(rank=s.rank, pid=survivors.get((s.hostname, s.local_rank)))
            for s in get_host_assignments(self.round_hosts, 0)
        }
        self.first_report_at = None
        self.state = RUNNING_JOB
        metrics.job_state(self.state)
        self.log.info("round_started", round=self.round, size=reply["size"], resets=self.resets, replaced=self.round - 1 if replacing else None)
        self._publish(
            "round",
            {
                "round": self.round, "hosts": self.round_hosts, "size": reply["size"], "command": self.spec.command, "cwd": self.spec.cwd, "env": self.spec.env, "job": self.job_id,
                "max_restarts": self.spec.max_restarts, "restart_window": self.spec.restart_window, "job_key": self.job_key,
                "checkpoint_dir": self.spec.checkpoint_dir, "checkpoint_interval": self.spec.checkpoint_interval,
            },
        )
        return True

    def _finish(self, state: str, reason: str, exit_code: int) -> None:
        self.state, self.reason, self.exit_code = state, reason, exit_code
        metrics.job_state(state)
        self.log.info("job_finished", job=self.job_id, state=state, exit_code=exit_code, reason=reason)
        self._publish("job_finished", {"job": self.job_id, "state": state, "exit_code": exit_code, "reason": reason})

    def _publish(self, event: str, data: dict[str, Any]) -> None:
        """Queue an event; it goes out after the state that caused it is saved (`_commit`)."""
        self.outbox.put(event, data)

    def close(self) -> None:
        self._commit()
        for c in (self.discovery, self.rendezvous):
            c.close()
        self.store.close()
        super().close()
