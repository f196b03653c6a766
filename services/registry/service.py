"""RegistryService: holds the job and drives it (Horovod's ElasticDriver and WorkerStateRegistry).

Messages:
  submit {spec}                       -> {job}        a new job (refused while one runs)
  job                                 -> {state, round, size, resets, exit_code, reason}
  status                              -> job + every worker of the current round
  cancel {reason}                     stop the job (elasticctl run interrupted)
  worker_exited {host, local_rank, pid, exit_code, restarting, gave_up, after_script_end, snapshot_commit}
                                      -> {recorded}   from agents (services/registry/exits.py)

The job is one record (services/registry/job.py) whose round's reports are a
table (services/registry/reports.py). The driver works in passes: on every
tick where none is under way, a pass reads the host set (discovery) and then
the rounds (rendezvous) without blocking the loop (services/registry/peers.py),
and with both answers starts a round when enough slots exist, or records READY
/ RUNNING / FAILURE from what it read and, once every slot of the round has
reported, reads the hosts' snapshots and applies `decisions.decide`. A round
still forming (no worker has its rank yet) when the host set changes (a drain,
a host lost or added) is replaced at once by a round on the hosts as they are
now, instead of forming, training and resetting. Events go to agents through
the notifier: `round` (services/registry/plan.py), `abort`, `kill_worker`,
`job_finished`.

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

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bus.client import ServiceError, Unreachable, incarnation_id
from bus.config import Endpoints, Timing
from bus.jobspec import JobSpec, SpecError
from bus.outbox import Outbox
from bus.service import Request, RequestError, Service, handles
from services.registry import metrics
from services.registry.decisions import Decision, decide, reset_cause
from services.registry.exits import WorkerExit
from services.registry.hosts import (
    agent_incarnations,
    any_usable,
    available_slots,
    discovery_settings,
    host_marks,
    newest_snapshot,
    restarted_agents,
)
from services.registry.job import FAILED, RUNNING_JOB, SUCCEEDED, WAITING, Job, Now
from services.registry.peers import Peer
from services.registry.plan import round_plan
from services.registry.reports import PENDING, SILENT, SUCCESS, Slot
from services.registry.store import JobStore


class RegistryService(Service):
    name = "registry"

    def __init__(self, endpoint: str, peers: Endpoints, timing: Timing, state_dir: Path, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        sender = incarnation_id(self.name)
        self.discovery, self.rendezvous = Peer(self, peers.discovery, sender), Peer(self, peers.rendezvous, sender)
        self.store = JobStore(state_dir)
        saved = self.store.load(parts=("reports",)) or {}
        self.outbox = Outbox(self, peers.notifier, sender, self.security, ((e, d) for e, d in saved.get("outbox", [])))
        self.last_job_id: int = saved.get("last_job_id", 0)
        self.discovery_incarnation: str | None = saved.get("discovery_incarnation")
        self.job = Job.from_saved(saved["job"], saved["reports"], Now.read(self.clock)) if saved else Job()
        if saved:
            self.log.info(
                "job_recovered",
                job=self.job.job_id,
                state=self.job.state,
                round=self.job.round,
                resets=self.job.resets,
                store=str(self.store.path),
            )
        metrics.job_state(self.job.state)
        self.outbox.flush()
        self.every(timing.driver_tick, self._tick)

    @property
    def _spec(self) -> JobSpec:
        assert self.job.spec is not None, "only a submitted job is driven"
        return self.job.spec

    def _commit(self) -> None:
        """Save what changed, then send the events it caused (`outbox.put` only queues them): nothing goes out that
        a restart could forget."""
        saved = {
            "last_job_id": self.last_job_id,
            "discovery_incarnation": self.discovery_incarnation,
            "outbox": [list(event) for event in self.outbox.queued],
            "job": self.job.to_saved(Now.read(self.clock)),
        }
        self.store.save(saved, {"reports": self.job.reports.to_saved()})
        self.outbox.flush()

    # -- requests ------------------------------------------------------------------------------
    @handles("submit")
    def on_submit(self, request: Request) -> dict[str, Any]:
        if self.job.active:
            raise RequestError("job_running", f"job {self.job.job_id} is still {self.job.state}; one job at a time")
        try:
            spec = JobSpec.parse(request.body.get("spec"))
        except SpecError as exc:
            raise RequestError(exc.code, str(exc)) from None
        try:
            self.rendezvous.write("reset")
            configured = self.discovery.write("configure", discovery_settings(spec))
        except (Unreachable, ServiceError) as exc:
            raise RequestError("unavailable", f"cannot prepare the job: {exc}") from None
        self.last_job_id += 1
        self.job = Job.submitted(spec, self.last_job_id, self.clock())
        self.discovery_incarnation = configured.get("incarnation")
        metrics.job_state(self.job.state)
        self.log.info(
            "job_submitted", job=self.job.job_id, command=spec.command, min_np=spec.min_np, max_np=spec.max_np
        )
        self._commit()
        return {"job": self.job.job_id}

    @handles("cancel")
    def on_cancel(self, request: Request) -> dict[str, Any]:
        if self.job.active:
            self._finish(FAILED, str(request.body.get("reason") or "cancelled"), 130)
            self._commit()
        return self.job.summary()

    @handles("job")
    def on_job(self, request: Request) -> dict[str, Any]:
        return self.job.summary()

    @handles("status")
    def on_status(self, request: Request) -> dict[str, Any]:
        return {**self.job.summary(), "workers": self.job.reports.status_rows(), "history": self.job.history[-20:]}

    @handles("worker_exited")
    def on_worker_exited(self, request: Request) -> dict[str, Any]:
        exited = WorkerExit.parse(request.body)
        if exited.snapshot_commit:
            self.job.note_snapshot_commit(exited.slot[0], exited.snapshot_commit)
        recorded = self._record_exit(exited)
        self._commit()
        return {"recorded": recorded}

    def _record_exit(self, exited: WorkerExit) -> bool:
        """Record the exit of the current round's worker of its slot (True); an exit after the job's end, or of a
        process that is not that worker, changes no report (a slot given up still costs its host)."""
        (host, local_rank), reports = exited.slot, self.job.reports
        seen = {"host": host, "local_rank": local_rank, "pid": exited.pid, "exit_code": exited.exit_code}
        if self.job.state in (SUCCEEDED, FAILED):
            self.log.info("worker_exited_after_job_end", **seen)
            return False
        if not reports.is_current_worker(exited.slot, exited.pid):
            self.log.info("worker_left", **seen)
            if exited.gave_up and self.job.active:
                self._blacklist(host, f"slot {local_rank} {exited.gave_up}")
            return False
        success = exited.success()
        if success is None:
            self._fail_slot(
                exited.slot, exited.failure(), pid=exited.pid, exit_code=exited.exit_code, host_stays=exited.host_stays
            )
        else:
            reports.record_success(exited.slot, exited.pid, exited.exit_code, success)
            if exited.exit_code != 0:
                self.log.warning("worker_died_after_its_script_ended", rank=reports[exited.slot].rank, **seen)
        self.job.note_report(self.clock())
        self.log.info("worker_exited", rank=reports[exited.slot].rank, round=self.job.round, **seen)
        return True

    # -- the driver: a pass reads discovery, then rendezvous, then acts ---------------------------
    def _tick(self) -> None:
        if self.job.active and not (self.discovery.reading or self.rendezvous.reading):
            self._read(self.discovery, "hosts", {"brief": True}, self._read_rounds)

    def _read(self, peer: Peer, msg_type: str, body: dict[str, Any], then: Callable[[dict[str, Any]], None]) -> None:
        """Read from `peer` without waiting: `then(answer)` runs if the job it was asked for still runs."""
        job = self.job

        def answered(answer: dict[str, Any]) -> None:
            if self.job is job and job.active:
                then(answer)

        peer.read(msg_type, body, answered, self._blind)

    def _blind(self, exc: Exception) -> None:
        self.log.warning("driver_blind", reason=str(exc))

    def _settle(self) -> None:
        """The end of a step of a pass: the metrics and the store catch up with what it changed."""
        metrics.workers(self.job.reports.counts())
        self._commit()

    def _read_rounds(self, hosts: dict[str, Any]) -> None:
        pending = self.job.state == RUNNING_JOB and self.job.reports.count(PENDING) > 0
        self._read(
            self.rendezvous,
            "status",
            {"parked_after": self.job.round, "pids": pending},
            lambda rounds: self._drive(hosts, rounds),
        )

    def _drive(self, hosts: dict[str, Any], rounds: dict[str, Any]) -> None:
        try:
            if not self._reconciled(hosts, rounds):
                return
        except (Unreachable, ServiceError) as exc:
            self._blind(exc)
            return
        if self.job.state == WAITING:
            self._start_round(hosts)
        else:
            self._observe(hosts, rounds)
        self._settle()

    def _reconciled(self, hosts: dict[str, Any], rounds: dict[str, Any]) -> bool:
        """Give a restarted discovery or rendezvous back what the job had; True when both agree with the job and
        discovery has heard from its agents (the driver may judge hosts and start rounds)."""
        job = self.job
        if hosts.get("incarnation") != self.discovery_incarnation:
            self.discovery.write(
                "restore", {**discovery_settings(self._spec), "marks": job.host_marks, "expected": job.round_hosts}
            )
            self.discovery_incarnation = hosts.get("incarnation")
            self.log.info(
                "discovery_restored",
                incarnation=self.discovery_incarnation,
                marks=sorted(job.host_marks),
                expected=[h for h, _ in job.round_hosts],
            )
            return False
        if rounds.get("round", 0) < job.round and job.round_hosts:
            restored = job.restored_round()
            self.rendezvous.write("restore_round", restored)
            self.log.info("rendezvous_restored", round=job.round, released=restored["released"])
            return False
        if hosts.get("settling"):
            return False
        job.host_marks = host_marks(hosts, job.host_marks, time.time())
        return True

    # -- a running round -----------------------------------------------------------------------
    def _observe(self, hosts: dict[str, Any], rounds: dict[str, Any]) -> None:
        """One look at the running round, in phases: a round still forming on hosts that changed is replaced;
        otherwise what discovery and rendezvous say of its slots is recorded, silent slots past the hung timeout
        are judged, and once every slot has reported the driver reads the snapshots and decides."""
        current = rounds.get("round") == self.job.round
        if current and not rounds.get("released") and hosts.get("timestamp") != self.job.round_hosts_timestamp:
            if self._start_round(hosts, replacing=True):
                return
        self._fail_slots_of_lost_hosts_and_restarted_agents(hosts)
        if current and rounds.get("released"):
            self._note_release(rounds.get("pids", []))
        self._note_rejoins(rounds.get("parked", []))
        self._check_hung()
        if self.job.reports.all_reported():
            self._read(self.discovery, "hosts", {}, self._decide)

    def _fail_slots_of_lost_hosts_and_restarted_agents(self, hosts: dict[str, Any]) -> None:
        """A lost host's silent slots fail; so do those of a host whose agent restarted (its workers died with the
        old one; the host stays)."""
        lost, restarted = set(hosts.get("lost", [])), restarted_agents(hosts, self.job.agents)
        for host, local_ranks in self.job.round_hosts:
            if host not in lost and host not in restarted:
                continue
            for slot in ((host, local_rank) for local_rank in local_ranks):
                if self.job.reports[slot].state not in SILENT:
                    continue
                if host in lost:
                    self._fail_slot(slot, "host lost (missed heartbeats)")
                else:
                    self._fail_slot(slot, "its agent restarted (the workers died with the old one)", host_stays=True)

    def _note_release(self, pids: list[list[Any]]) -> None:
        """The round is released: the failure that led to it, if any, is recovered from, and the workers that
        joined it ([host, local_rank, pid]) have their ranks."""
        recovery = self.job.recovered(self.clock())
        if recovery is not None:
            metrics.recovered(recovery)
        for host, local_rank, pid in pids:
            self.job.reports.record_started((host, local_rank), pid)

    def _note_rejoins(self, parked: list[dict[str, Any]]) -> None:
        """Workers that asked to join a round after this one are READY: they survived it."""
        for join in parked:
            if join["after_round"] >= self.job.round and self.job.reports.record_rejoined(
                (join["host"], join["local_rank"]), join["pid"]
            ):
                self.job.note_report(self.clock())

    def _check_hung(self) -> None:
        """Slots silent `hung_timeout` after the round's first report: after a success the job is done and the rest
        are stopped; otherwise they count as failed (hung) and their agents kill them."""
        hung_timeout, reports = self._spec.hung_timeout, self.job.reports
        if self.job.first_report_at is None or self.clock() - self.job.first_report_at < hung_timeout:
            return
        if reports.count(SUCCESS):
            self._apply(
                Decision("succeed", f"job finished ({len(reports.silent())} worker(s) still running were stopped)")
            )
            return
        for slot in reports.silent():
            self._fail_slot(slot, f"hung: no report {hung_timeout:g}s after the round's first")
            self.outbox.put("kill_worker", {"host": slot[0], "local_rank": slot[1], "pid": reports[slot].pid})

    def _fail_slot(
        self, slot: Slot, reason: str, *, pid: int | None = None, exit_code: int | None = None, host_stays: bool = False
    ) -> None:
        reports = self.job.reports
        first = reports.record_failure(slot, reason, pid=pid, exit_code=exit_code, host_stays=host_stays)
        self.job.note_report(self.clock())
        self.log.warning(
            "worker_failed",
            host=slot[0],
            local_rank=slot[1],
            rank=reports[slot].rank,
            reason=reason,
            round=self.job.round,
        )
        if first:
            self.job.note_failure(self.clock())
            self.outbox.put("abort", {"round": self.job.round})

    def _decide(self, hosts: dict[str, Any]) -> None:
        """Every slot has reported: apply `decisions.decide` to the reports and the newest snapshot live hosts keep."""
        job, torchrun = self.job, self._spec.mode == "torchrun"
        self._apply(
            decide(
                job.reports.reports,
                job.resets_toward_limit(torchrun),
                self._spec.reset_limit,
                newest_snapshot(hosts, job.snapshot_commits),
                job.resumed_from,
                torchrun,
            )
        )
        self._settle()

    def _apply(self, decision: Decision) -> None:
        self.job.note_decision(decision)
        if decision.action == "succeed":
            self._finish(SUCCEEDED, decision.reason, 0)
        elif decision.action == "fail":
            self._finish(FAILED, decision.reason, decision.exit_code)
        else:
            self._reset(decision)

    def _reset(self, decision: Decision) -> None:
        """The job goes on in a new round: the failed hosts that do not stay are blacklisted, the job waits for slots
        again, and after a blacklist the driver reads whether any usable host is left."""
        for host, failed in self.job.reports.failures_on(decision.blacklist).items():
            self._blacklist(host, f"round {self.job.round}: {'; '.join(failed)}")
        if decision.resume_from:
            self.job.resumed_from = decision.resume_from
        self.log.info("round_reset", round=self.job.round, reason=decision.reason or "hosts changed")
        metrics.reset(reset_cause(decision, (report.reason for _, report in self.job.reports.failures())))
        self.job.wait_for_next_round(self.clock())
        metrics.job_state(self.job.state)
        if decision.blacklist:
            self._read(self.discovery, "hosts", {}, lambda hosts: self._fail_if_no_usable_host(hosts, decision.reason))

    def _fail_if_no_usable_host(self, hosts: dict[str, Any], reason: str) -> None:
        if not any_usable(hosts):
            self._finish(FAILED, f"every host is blacklisted ({reason})", 1)
        self._settle()

    def _blacklist(self, host: str, reason: str) -> None:
        try:
            self.discovery.write("blacklist", {"host": host, "reason": reason})
        except (Unreachable, ServiceError) as exc:
            self.log.warning("blacklist_failed", host=host, reason=str(exc))

    # -- a new round ---------------------------------------------------------------------------
    def _start_round(self, hosts: dict[str, Any], replacing: bool = False) -> bool:
        """Start a round on the available hosts; True when it started. `replacing`: the current round is still
        forming (no worker has its rank) and the hosts changed since it began: a new round on the hosts as they
        are now replaces it at once, instead of waiting for it to form, train and reset (not counted as a reset)."""
        if not self._enough_slots(hosts, replacing) or self._reset_limit_reached(replacing):
            return False
        reply = self._ask_for_round(hosts, replacing)
        if reply is None:
            return False
        self._begin_round(reply, hosts, replacing)
        return True

    def _enough_slots(self, hosts: dict[str, Any], replacing: bool) -> bool:
        """Are `min_np` slots available? A job that waited longer than its `elastic_timeout` for them fails (a
        replacement does not wait: the forming round goes on)."""
        spec, total = self._spec, available_slots(hosts)
        if total >= spec.min_np:
            return True
        if not replacing and self.clock() - self.job.waiting_since > spec.elastic_timeout:
            self._finish(
                FAILED,
                f"timed out after {spec.elastic_timeout:g}s waiting for {spec.min_np} slot(s); {total} available",
                1,
            )
        return False

    def _reset_limit_reached(self, replacing: bool) -> bool:
        """A new round after the first is a reset (unless it replaces one still forming): at the reset limit the job
        fails instead (in torchrun mode `decide` does, counting the restarts after a failure only)."""
        limit = self._spec.reset_limit
        if replacing or self.job.round < 1 or limit is None or self.job.resets < limit or self._spec.mode == "torchrun":
            return False
        self._finish(FAILED, f"reset limit {limit} reached", 1)
        return True

    def _ask_for_round(self, hosts: dict[str, Any], replacing: bool) -> dict[str, Any] | None:
        """The rendezvous' next round on the available hosts; None when it refused (a job no host survives fails)
        or could not be reached."""
        spec = self._spec
        asked = {
            "hosts": hosts.get("available", []),
            "min_np": spec.min_np,
            "max_np": spec.max_np,
            "hosts_timestamp": hosts["timestamp"],
            "replaces": self.job.round if replacing else None,
            "round": self.job.round + 1,
        }
        try:
            return self.rendezvous.write("new_round", asked)
        except ServiceError as exc:
            if exc.code == "no_surviving_host":
                self._finish(FAILED, exc.message, 1)
            elif exc.code != "released":
                self.log.warning("round_refused", code=exc.code, reason=exc.message)
        except Unreachable as exc:
            self._blind(exc)
        return None

    def _begin_round(self, reply: dict[str, Any], hosts: dict[str, Any], replacing: bool) -> None:
        """The rendezvous made the round: the job records it and the agents are told (`round`)."""
        self.job.begin_round(
            reply["round"], reply["hosts"], reply["hosts_timestamp"], agent_incarnations(hosts), replacing
        )
        metrics.round_started()
        metrics.job_state(self.job.state)
        self.log.info(
            "round_started",
            round=self.job.round,
            size=reply["size"],
            resets=self.job.resets,
            replaced=self.job.round - 1 if replacing else None,
        )
        self.outbox.put("round", round_plan(self.job, reply["size"]))

    def _finish(self, state: str, reason: str, exit_code: int) -> None:
        self.job.finish(state, reason, exit_code)
        metrics.job_state(state)
        self.log.info("job_finished", job=self.job.job_id, state=state, exit_code=exit_code, reason=reason)
        self.outbox.put(
            "job_finished", {"job": self.job.job_id, "state": state, "exit_code": exit_code, "reason": reason}
        )

    def close(self) -> None:
        self._commit()
        for peer in (self.discovery, self.rendezvous):
            peer.close()
        self.store.close()
        super().close()
