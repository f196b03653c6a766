"""Driver: what the registry does to its job with what a pass read (Horovod's ElasticDriver).

Given discovery's host set and the rendezvous's rounds, read at one instant
`now`: a job waiting for slots gets a round when enough exist (or fails past
its elastic timeout or at its reset limit); a running round still forming
(no worker has its rank yet) on hosts that changed is replaced at once by a
round on the hosts as they are now; otherwise what discovery and the
rendezvous say of its slots is recorded (lost hosts, restarted agents, the
release, re-joins), silent slots past the hung timeout are judged, and once
every slot has reported the pass reads the hosts' snapshots and the driver
applies `decisions.decide` (`judge`). Exits that agents report are recorded
here too (`record_exit`); the exit of a worker killed as hung
(services/registry/waits.py judges hangs) is told with its stack
(`worker_hung`).

The driver changes the job record and queues events in the outbox (`round`,
`abort`, `kill_worker`, `worker_hung`, `job_finished`); it never saves: the
registry saves once at the end of the pass or request, then sends the events.
Its writes to peers (a round, a blacklist) wait for their answers
(services/registry/peers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elastic_control_plane.bus.client import TEMPORARY_REFUSALS, ServiceError, Unreachable
from elastic_control_plane.bus.contract import Event
from elastic_control_plane.bus.outbox import Outbox
from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.registry import metrics
from elastic_control_plane.services.registry.decisions import Decision, decide, reset_cause
from elastic_control_plane.services.registry.exits import WorkerExit
from elastic_control_plane.services.registry.goodput import headline, planned_change
from elastic_control_plane.services.registry.hosts import (
    agent_incarnations,
    available_slots,
    newest_snapshot,
    restarted_agents,
)
from elastic_control_plane.services.registry.job import FAILED, SUCCEEDED, WAITING, Job
from elastic_control_plane.services.registry.peers import Peer
from elastic_control_plane.services.registry.plan import round_plan
from elastic_control_plane.services.registry.reports import READY, SILENT, SUCCESS, Slot

UNSENT_RETRY_S = 1.0  # a blacklist discovery refused for now is sent again this often


class Driver:
    def __init__(
        self,
        job: Job,
        discovery: Peer,
        rendezvous: Peer,
        outbox: Outbox,
        log: Any,
        lost_after: float = 0.0,
        stalled_for: Callable[[float], float | None] = lambda now: None,
    ) -> None:
        self.job, self.discovery, self.rendezvous, self.outbox, self.log = job, discovery, rendezvous, outbox, log
        # When a failure began, for the goodput ledger: a host is lost `lost_after` after its last heartbeat; the
        # other ranks have waited `stalled_for(now)` in a collective (services/registry/waits.py `longest_wait`; None:
        # no rank's waits are known).
        self.lost_after, self.stalled_for = lost_after, stalled_for
        # Where the rendezvous's log of rejoins was read up to: its round and the cursor in it (kept in memory only:
        # a new driver reads the log from its start, and a rejoin read twice is recorded once).
        self.rejoins_round, self.rejoins_from = 0, 0
        self.quota_refused: dict[str, int] = {}  # the rendezvous's count, by host, of keys refused past a round's quota
        self.unsent_blacklists: dict[str, str] = {}  # host: reason, for the blacklists discovery could not take yet
        self._unsent_sent_at = -UNSENT_RETRY_S

    @property
    def spec(self) -> JobSpec:
        assert self.job.spec is not None, "only a submitted job is driven"
        return self.job.spec

    def blind(self, exc: Exception) -> None:
        self.log.warning("driver_blind", reason=str(exc))

    def status_query(self, pids: bool) -> dict[str, Any]:
        """The rendezvous's `status` request of a pass: the rejoins since the last pass, the workers' pids if `pids`."""
        return {"round": self.rejoins_round, "rejoins_from": self.rejoins_from, "pids": pids}

    def drive(self, hosts: dict[str, Any], rounds: dict[str, Any], now: float) -> bool:
        """One look at the job with what the pass read; True when every slot of the round has reported (the pass
        then reads the hosts' snapshots for `judge`)."""
        self.send_unsent_blacklists(now)
        rejoins = rounds.get("rejoins", [])
        self.rejoins_round, self.rejoins_from = rounds.get("round", 0), rounds.get("rejoins_next", 0)
        self.quota_refused = rounds.get("quota_refused") or {}
        if self.job.state == WAITING:
            self._start_round(hosts, now)
            return False
        current = rounds.get("round") == self.job.round
        if current and not rounds.get("released") and hosts.get("timestamp") != self.job.round_hosts_timestamp:
            if self._start_round(hosts, now, replacing=True):
                return False
        self._fail_slots_of_lost_hosts_and_restarted_agents(hosts, now)
        if current and rounds.get("released"):
            self._note_release(rounds.get("pids", []), now)
        self._note_rejoins(rejoins, now)
        self._note_planned_change(hosts, now)
        self._check_hung(now)
        return self.job.reports.all_reported()

    # -- exits ---------------------------------------------------------------------------------
    def record_exit(self, exited: WorkerExit, now: float) -> bool:
        """Record the exit of the current round's worker of its slot (True); an exit after the job's end, or of a
        process that is not that worker, changes no report (a slot given up still costs its host)."""
        if exited.snapshot_commit:
            self.job.note_snapshot_commit(exited.slot[0], exited.snapshot_commit)
        (host, local_rank), reports = exited.slot, self.job.reports
        seen = {"host": host, "local_rank": local_rank, "pid": exited.pid, "exit_code": exited.exit_code}
        if self.job.state in (SUCCEEDED, FAILED):
            self.log.info("worker_exited_after_job_end", **seen)
            return False
        if not reports.is_current_worker(exited.slot, exited.pid):
            self.log.info("worker_left", **seen)
            if exited.gave_up and self.job.active:
                self.blacklist(host, f"slot {local_rank} {exited.gave_up}")
            return False
        success = exited.success()
        if success is None:
            self._fail_slot(
                exited.slot,
                exited.failure(),
                now,
                pid=exited.pid,
                exit_code=exited.exit_code,
                host_stays=exited.host_stays,
            )
            if exited.hung:
                rank, reason, stack = reports[exited.slot].rank, exited.hung, exited.stack
                hung = {"host": host, "local_rank": local_rank, "rank": rank, "pid": exited.pid, "reason": reason}
                self.log.warning("hung_worker_killed", **hung, stack=stack)
                self.outbox.put(Event.WORKER_HUNG, {**hung, "stack": stack})
        else:
            reports.record_success(exited.slot, exited.pid, exited.exit_code, success)
            if exited.exit_code != 0:
                self.log.warning("worker_died_after_its_script_ended", rank=reports[exited.slot].rank, **seen)
        self.job.note_report(now)
        self.log.info("worker_exited", rank=reports[exited.slot].rank, round=self.job.round, **seen)
        return True

    # -- a running round -----------------------------------------------------------------------
    def _fail_slots_of_lost_hosts_and_restarted_agents(self, hosts: dict[str, Any], now: float) -> None:
        """A lost host's silent slots fail (lost for its silence, or on its source's word: a Slurm node DOWN, lost
        when it was found); so do those of a host whose agent restarted (its workers died with the old one; the host
        stays)."""
        lost, restarted = set(hosts.get("lost", [])), restarted_agents(hosts, self.job.agents)
        declared = set(hosts.get("lost_declared", []))
        reports = self.job.reports
        in_round = [slots for slots in map(reports.slots_on, lost | restarted) if slots]
        for slots in sorted(in_round, key=lambda slots: reports[slots[0]].rank):  # in rank order
            host = slots[0][0]
            for slot in slots:
                if reports[slot].state not in SILENT:
                    continue
                if host in declared:
                    self._fail_slot(slot, "host lost (its node is down, as Slurm says)", now, silent_for=0.0)
                elif host in lost:
                    self._fail_slot(slot, "host lost (missed heartbeats)", now)
                else:
                    why = "its agent restarted (the workers died with the old one)"
                    self._fail_slot(slot, why, now, host_stays=True)

    def _note_release(self, pids: list[list[Any]], now: float) -> None:
        """The round is released: the failure that led to it, if any, is recovered from, and the workers that
        joined it ([host, local_rank, pid]) have their ranks."""
        self.job.ledger.released(now, self.job.round, len(self.job.reports))
        recovery = self.job.recovered(now)
        if recovery is not None:
            metrics.recovered(recovery)
        for host, local_rank, pid in pids:
            self.job.reports.record_started((host, local_rank), pid)

    def _note_rejoins(self, rejoins: list[list[Any]], now: float) -> None:
        """Workers that asked to join a round after this one ([host, local_rank, pid, after_round]) are READY: they
        survived it."""
        for host, local_rank, pid, after_round in rejoins:
            if after_round >= self.job.round and self.job.reports.record_rejoined((host, local_rank), pid):
                self.job.note_report(now)

    def _note_planned_change(self, hosts: dict[str, Any], now: float) -> None:
        """Workers re-join with no fault under way: the ledger's interruption is the change of hosts they saw, or,
        none seen, a fault not told yet (its training stopped now)."""
        if self.job.ledger.interruption is None and self.job.reports.count(READY):
            change = planned_change(self.job.ledger, self.job.round_hosts, hosts)
            if change is None:
                self.job.ledger.stopped(now)
                return
            cause, host, planned = change
            self.job.ledger.fault(now, now, cause, host, "hosts changed", planned=planned)

    def _check_hung(self, now: float) -> None:
        """Slots silent `hung_timeout` after the round's first report: after a success the job is done and the rest
        are stopped; otherwise they count as failed (hung) and their agents kill them."""
        hung_timeout, reports = self.spec.hung_timeout, self.job.reports
        if self.job.first_report_at is None or now - self.job.first_report_at < hung_timeout:
            return
        if reports.count(SUCCESS):
            stopped = len(reports.silent())
            self._apply(Decision("succeed", f"job finished ({stopped} worker(s) still running were stopped)"), now)
            return
        for slot in reports.silent():
            self._fail_slot(slot, f"hung: no report {hung_timeout:g}s after the round's first", now)
            self.outbox.put(Event.KILL_WORKER, {"host": slot[0], "local_rank": slot[1], "pid": reports[slot].pid})

    def _fail_slot(
        self,
        slot: Slot,
        reason: str,
        now: float,
        *,
        pid: int | None = None,
        exit_code: int | None = None,
        host_stays: bool = False,
        silent_for: float | None = None,
    ) -> None:
        """`silent_for`: how long before `now` the failure began, when known (else a lost host's: `lost_after`)."""
        reports = self.job.reports
        first = reports.record_failure(slot, reason, pid=pid, exit_code=exit_code, host_stays=host_stays)
        self.job.note_report(now)
        self.log.warning(
            "worker_failed",
            host=slot[0],
            local_rank=slot[1],
            rank=reports[slot].rank,
            reason=reason,
            round=self.job.round,
        )
        if first:
            silent = self.lost_after if silent_for is None else silent_for
            self.job.note_failure(now, slot[0], reason, silent, self.stalled_for(now))
            self.outbox.put(Event.ABORT, {"round": self.job.round})

    # -- every slot reported -------------------------------------------------------------------
    def judge(self, snapshots: dict[str, Any], now: float) -> Decision:
        """Every slot has reported: apply `decisions.decide` to the reports and the newest snapshot live hosts keep
        (`snapshots`: discovery's answer to `snapshots`)."""
        job, torchrun = self.job, self.spec.mode == "torchrun"
        decision = decide(
            job.reports.reports,
            job.resets_toward_limit(torchrun),
            self.spec.reset_limit,
            newest_snapshot(snapshots, job.snapshot_commits),
            job.resumed_from,
            torchrun,
        )
        self._apply(decision, now)
        return decision

    def _apply(self, decision: Decision, now: float) -> None:
        self.job.note_decision(decision, now)
        if decision.action == "succeed":
            self.finish(SUCCEEDED, decision.reason, 0, now)
        elif decision.action == "fail":
            self.finish(FAILED, decision.reason, decision.exit_code, now)
        else:
            self._reset(decision, now)

    def _reset(self, decision: Decision, now: float) -> None:
        """The job goes on in a new round: the failed hosts that do not stay are blacklisted and the job waits for
        slots again (after a blacklist the pass reads whether any usable host is left: `fail_if_no_usable_host`)."""
        for host, failed in self.job.reports.failures_on(decision.blacklist).items():
            self.blacklist(host, f"round {self.job.round}: {'; '.join(failed)}")
        if decision.resume_from:
            self.job.resumed_from = decision.resume_from
        self.log.info("round_reset", round=self.job.round, reason=decision.reason or "hosts changed")
        metrics.reset(reset_cause(decision, (report.reason for _, report in self.job.reports.failures())))
        self.job.wait_for_next_round(now)
        metrics.job_state(self.job.state)

    def fail_if_no_usable_host(self, snapshots: dict[str, Any], reason: str, now: float) -> None:
        """`snapshots`: discovery's answer to `snapshots`, which says whether any host is neither lost nor
        blacklisted."""
        if not snapshots.get("usable"):
            self.finish(FAILED, f"every host is blacklisted ({reason})", 1, now)

    def blacklist(self, host: str, reason: str) -> None:
        """Tell discovery to blacklist `host`. Refused for now (`unavailable`) or unanswered, it is kept and sent
        again at the start of every pass (`send_unsent_blacklists`) until discovery takes it: a decision is delayed,
        never dropped. Refused for good (an unknown host), it is said and dropped."""
        try:
            self.discovery.write("blacklist", {"host": host, "reason": reason})
            self.unsent_blacklists.pop(host, None)
        except (Unreachable, ServiceError) as exc:
            if isinstance(exc, ServiceError) and exc.code not in TEMPORARY_REFUSALS:
                self.log.warning("blacklist_failed", host=host, reason=str(exc))
                self.unsent_blacklists.pop(host, None)
            elif host not in self.unsent_blacklists:
                self.log.warning("blacklist_delayed", host=host, reason=str(exc))
                self.unsent_blacklists[host] = reason

    def send_unsent_blacklists(self, now: float) -> None:
        """Send the blacklists discovery could not take yet, once a second at most."""
        if self.unsent_blacklists and now - self._unsent_sent_at >= UNSENT_RETRY_S:
            self._unsent_sent_at = now
            for host, reason in list(self.unsent_blacklists.items()):
                self.blacklist(host, reason)

    # -- a new round ---------------------------------------------------------------------------
    def _start_round(self, hosts: dict[str, Any], now: float, replacing: bool = False) -> bool:
        """Start a round on the available hosts; True when it started. `replacing`: the current round is still
        forming (no worker has its rank) and the hosts changed since it began: a new round on the hosts as they
        are now replaces it at once, instead of waiting for it to form, train and reset (not counted as a reset)."""
        if not self._enough_slots(hosts, now, replacing) or self._reset_limit_reached(replacing, now):
            return False
        reply = self._ask_for_round(hosts, replacing, now)
        if reply is None:
            return False
        self._begin_round(reply, hosts, replacing)
        return True

    def _enough_slots(self, hosts: dict[str, Any], now: float, replacing: bool) -> bool:
        """Are `min_np` slots available? A job that waited longer than its `elastic_timeout` for them fails (a
        replacement does not wait: the forming round goes on)."""
        spec, total = self.spec, available_slots(hosts)
        self.job.ledger.slots(now, enough=total >= spec.min_np)
        if total >= spec.min_np:
            return True
        if not replacing and now - self.job.waiting_since > spec.elastic_timeout:
            waited = f"timed out after {spec.elastic_timeout:g}s waiting for {spec.min_np} slot(s); {total} available"
            self.finish(FAILED, waited, 1, now)
        return False

    def _reset_limit_reached(self, replacing: bool, now: float) -> bool:
        """A new round after the first is a reset (unless it replaces one still forming): at the reset limit the job
        fails instead (in torchrun mode `decide` does, counting the restarts after a failure only)."""
        limit = self.spec.reset_limit
        if replacing or self.job.round < 1 or limit is None or self.job.resets < limit or self.spec.mode == "torchrun":
            return False
        self.finish(FAILED, f"reset limit {limit} reached", 1, now)
        return True

    def _ask_for_round(self, hosts: dict[str, Any], replacing: bool, now: float) -> dict[str, Any] | None:
        """The rendezvous' next round on the available hosts; None when it refused (a job no host survives fails)
        or could not be reached."""
        asked = {
            "hosts": hosts.get("available", []),
            "min_np": self.spec.min_np,
            "max_np": self.spec.max_np,
            "hosts_timestamp": hosts["timestamp"],
            "replaces": self.job.round if replacing else None,
            "round": self.job.round + 1,
        }
        try:
            return self.rendezvous.write("new_round", asked)
        except ServiceError as exc:
            if exc.code == "no_surviving_host":
                self.finish(FAILED, exc.message, 1, now)
            elif exc.code != "released":
                self.log.warning("round_refused", code=exc.code, reason=exc.message)
        except Unreachable as exc:
            self.blind(exc)
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
        self.outbox.put(Event.ROUND, round_plan(self.job, reply["size"]))

    def finish(self, state: str, reason: str, exit_code: int, now: float) -> None:
        self.job.finish(state, reason, exit_code, now)
        metrics.job_state(state)
        goodput = headline(self.job.ledger.totals(now))
        self.log.info(
            "job_finished", job=self.job.job_id, state=state, exit_code=exit_code, reason=reason, goodput=goodput
        )
        self.outbox.put(
            Event.JOB_FINISHED, {"job": self.job.job_id, "state": state, "exit_code": exit_code, "reason": reason}
        )
