"""RegistryService: holds the job and drives it (Horovod's ElasticDriver and WorkerStateRegistry).

Messages:
  submit {spec}                       -> {job}        a new job (refused while one runs)
  job                                 -> {state, round, size, resets, exit_code, reason}
  status                              -> job + every worker of the current round
  cancel {reason}                     stop the job (elasticctl run interrupted)
  worker_exited {host, local_rank, pid, exit_code, restarting, gave_up, snapshot_commit}   from agents:
                                      `restarting` means the agent restarts the slot in place (the host stays);
                                      `gave_up` is the reason it stopped restarting a crash-looping slot (the host
                                      is blacklisted); `snapshot_commit` the commit in the host's snapshot

On every tick the driver reads the host set (discovery) and the rounds
(rendezvous): it starts a round when enough slots exist, records READY /
RUNNING / FAILURE from what it reads, and once every slot of the round has
reported, applies `decisions.decide`. Events go to agents through the notifier:
`round`, `abort`, `kill_worker`, `job_finished`.

Each job has a random key, handed to the agents with every `round`: host
snapshots are tagged with it, so a snapshot of another job is never restored.
The newest commit in a live host's snapshot (from the agents' heartbeats, via
discovery, and from their exit reports) lets a job whose every worker failed
resume from it.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

from bus.client import Client, ServiceError, Unreachable
from bus.config import Endpoints, Timing
from bus.service import Request, RequestError, Service, field, handles
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

NO_JOB, WAITING, RUNNING_JOB, SUCCEEDED, FAILED = "none", "waiting", "running", "succeeded", "failed"


class RegistryService(Service):
    name = "registry"

    def __init__(self, endpoint: str, peers: Endpoints, timing: Timing, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        self.timing = timing

        def client(address: str) -> Client:
            return Client(address, self.name, security=self.security, ctx=self.ctx, timeout=1.0, deadline=2.0)

        self.discovery, self.rendezvous, self.notifier = client(peers.discovery), client(peers.rendezvous), client(peers.notifier)
        self.job_ids = itertools.count(1)
        self._new_job(None)
        self.every(timing.driver_tick, self._tick)

    def _new_job(self, spec: JobSpec | None) -> None:
        self.spec = spec
        self.job_id = next(self.job_ids) if spec else 0
        self.job_key = uuid.uuid4().hex[:16] if spec else ""
        self.snapshot_commits: dict[str, int] = {}
        self.resumed_from = 0
        self.state = WAITING if spec else NO_JOB
        self.exit_code: int | None = None
        self.reason = ""
        self.resets = 0
        self.round = 0
        self.reports: dict[Slot, SlotReport] = {}
        self.retired_pids: set[int] = set()
        self.agents: dict[str, str] = {}
        self.hosts_timestamp = 0.0
        self.waiting_since = self.clock()
        self.first_report_at: float | None = None
        self.history: list[dict[str, Any]] = []

    # -- requests ------------------------------------------------------------------------------
    @handles("submit")
    def on_submit(self, request: Request) -> dict[str, Any]:
        if self.state in (WAITING, RUNNING_JOB):
            raise RequestError("job_running", f"job {self.job_id} is still {self.state}; one job at a time")
        spec = JobSpec.parse(request.body.get("spec"))
        try:
            self.rendezvous.request("reset")
            self.discovery.request(
                "configure",
                {"max_np": spec.max_np, "discovery_script": spec.discovery_script, "cooldown": list(spec.cooldown) if spec.cooldown else None},
            )
        except (Unreachable, ServiceError) as exc:
            raise RequestError("unavailable", f"cannot prepare the job: {exc}") from None
        self._new_job(spec)
        self.log.info("job_submitted", job=self.job_id, command=spec.command, min_np=spec.min_np, max_np=spec.max_np)
        return {"job": self.job_id}

    @handles("cancel")
    def on_cancel(self, request: Request) -> dict[str, Any]:
        if self.state in (WAITING, RUNNING_JOB):
            self._finish(FAILED, str(request.body.get("reason") or "cancelled"), 130)
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
        report = self.reports.get(slot)
        if report is None or not self._belongs_to_round(report, pid):
            self.log.info("worker_left", host=slot[0], local_rank=slot[1], pid=pid, exit_code=code)
            if gave_up and self.state in (WAITING, RUNNING_JOB):
                self._blacklist(slot[0], f"slot {slot[1]} {gave_up}")
            return {"recorded": False}
        report.pid, report.exit_code = pid, code
        if code == 0:
            report.state, report.reason = SUCCESS, "exited with code 0"
        else:
            report.host_stays = restarting and not gave_up
            why = f"; {gave_up}" if gave_up else "; restarting in place" if report.host_stays else ""
            self._fail_slot(slot, f"exited with code {code}{why}")
        self._note_report()
        self.log.info("worker_exited", host=slot[0], local_rank=slot[1], rank=report.rank, pid=pid, exit_code=code, round=self.round)
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
            hosts = self.discovery.request("hosts").body
            rounds = self.rendezvous.request("status").body
        except (Unreachable, ServiceError) as exc:
            self.log.warning("driver_blind", reason=str(exc))
            return
        if self.state == WAITING:
            self._start_round(hosts)
        elif self.state == RUNNING_JOB:
            self._observe(hosts, rounds)

    def _observe(self, hosts: dict[str, Any], rounds: dict[str, Any]) -> None:
        lost = set(hosts.get("lost", []))
        agents = self._agent_incarnations(hosts)
        for slot, report in self.reports.items():
            if slot[0] in lost and report.state not in REPORTED:
                self._fail_slot(slot, "host lost (missed heartbeats)")
            elif report.state not in REPORTED and slot[0] in agents and agents[slot[0]] != self.agents.get(slot[0]):
                report.host_stays = True
                self._fail_slot(slot, "its agent restarted (the workers died with the old one)")
        if rounds.get("round") == self.round and rounds.get("released"):
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
            newest = self._newest_snapshot(hosts)
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
        return {h["host"]: h["incarnation"] for h in hosts.get("all", []) if isinstance(h.get("incarnation"), str)}

    def _fail_slot(self, slot: Slot, reason: str) -> None:
        report = self.reports[slot]
        first = not any(r.state == FAILURE for r in self.reports.values())
        report.state, report.reason = FAILURE, reason
        report.failed_order = sum(r.state == FAILURE for r in self.reports.values())
        self._note_report()
        self.log.warning("worker_failed", host=slot[0], local_rank=slot[1], rank=report.rank, reason=reason, round=self.round)
        if first:
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
        self.history.append({"round": self.round, "action": decision.action, "reason": decision.reason})
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
        self.state = WAITING
        self.waiting_since = self.clock()
        if decision.blacklist:
            self._fail_if_all_blacklisted(decision.reason)

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

    def _start_round(self, hosts: dict[str, Any]) -> None:
        assert self.spec is not None
        available = hosts.get("available", [])
        total = sum(len(slots) if isinstance(slots, list) else slots for _, slots in available)
        if total < self.spec.min_np:
            waited = self.clock() - self.waiting_since
            if waited > self.spec.elastic_timeout:
                self._finish(
                    FAILED,
                    f"timed out after {self.spec.elastic_timeout:g}s waiting for {self.spec.min_np} slot(s); {total} available",
                    1,
                )
            return
        if self.round >= 1 and self.spec.reset_limit is not None and self.resets >= self.spec.reset_limit:
            self._finish(FAILED, f"reset limit {self.spec.reset_limit} reached", 1)
            return
        try:
            reply = self.rendezvous.request(
                "new_round",
                {"hosts": available, "min_np": self.spec.min_np, "max_np": self.spec.max_np, "hosts_timestamp": hosts["timestamp"]},
            ).body
        except ServiceError as exc:
            if exc.code == "no_surviving_host":
                self._finish(FAILED, exc.message, 1)
            else:
                self.log.warning("round_refused", code=exc.code, reason=exc.message)
            return
        except Unreachable as exc:
            self.log.warning("driver_blind", reason=str(exc))
            return
        if self.round >= 1:
            self.resets += 1
        survivors = {slot: r.pid for slot, r in self.reports.items() if r.state == READY}
        self.retired_pids.update(r.pid for r in self.reports.values() if r.pid is not None and r.state != READY)
        self.round = reply["round"]
        self.agents = self._agent_incarnations(hosts)
        self.reports = {
            (s["hostname"], s["local_rank"]): SlotReport(rank=s["rank"], pid=survivors.get((s["hostname"], s["local_rank"])))
            for s in reply["slots"]
        }
        self.first_report_at = None
        self.state = RUNNING_JOB
        self.log.info("round_started", round=self.round, size=reply["size"], resets=self.resets)
        self._publish(
            "round",
            {
                "round": self.round, "slots": reply["slots"], "command": self.spec.command, "cwd": self.spec.cwd, "env": self.spec.env, "job": self.job_id,
                "max_restarts": self.spec.max_restarts, "restart_window": self.spec.restart_window, "job_key": self.job_key,
                "checkpoint_dir": self.spec.checkpoint_dir, "checkpoint_interval": self.spec.checkpoint_interval,
            },
        )

    def _finish(self, state: str, reason: str, exit_code: int) -> None:
        self.state, self.reason, self.exit_code = state, reason, exit_code
        self.log.info("job_finished", job=self.job_id, state=state, exit_code=exit_code, reason=reason)
        self._publish("job_finished", {"job": self.job_id, "state": state, "exit_code": exit_code, "reason": reason})

    def _publish(self, event: str, data: dict[str, Any]) -> None:
        try:
            self.notifier.request("publish", {"event": event, "data": data})
        except (Unreachable, ServiceError) as exc:
            self.log.warning("publish_failed", event_type=event, reason=str(exc))

    def close(self) -> None:
        for c in (self.discovery, self.rendezvous, self.notifier):
            c.close()
        super().close()
