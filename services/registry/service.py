"""RegistryService: holds the job and drives it (Horovod's ElasticDriver and WorkerStateRegistry).

Messages:
  submit {spec, run_id?}              -> {job, attached?}  a new job (refused while one runs); with the run_id of the
                                      registry's job (running or ended), that job, attached: not submitted again
  job                                 -> {state, round, size, resets, exit_code, reason}
  status                              -> job + every worker of the current round + waits {limit_s, kill_s, upper_s,
                                         ranks, suspected, declared}
  cancel {reason}                     stop the job (elasticctl run interrupted)
  worker_exited {host, local_rank, pid, exit_code, restarting, gave_up, after_script_end, snapshot_commit,
                 hung, stack}         -> {recorded}   from agents (services/registry/exits.py)
  waits {host, slots, commit?}        -> {limit_s, kill_s, upper_s, excuse_s}   from agents: how long each worker
                                      waits for the others (services/registry/waits.py judges hangs and stragglers
                                      from them); commit {commit, age_s, saving_s, resumed_round, resumed_age_s}:
                                      the host's training progress
  ledger                              -> job, state, goodput: the job's goodput ledger (services/registry/ledger.py)

The job is one record (services/registry/job.py) whose round's reports are a
table (services/registry/reports.py). The registry drives it in passes, each
read -> decide -> write: on every tick where none is under way, a pass READS
the host set (discovery) and the rounds (rendezvous) at once, without
blocking the loop (services/registry/peers.py: `Pass`); with both answers the
DRIVER acts on the job (services/registry/driver.py, its judgement the pure
services/registry/decisions.py), reading the hosts' snapshots when every slot
has reported; and the pass WRITES once at its end: one save of what changed,
then the events it caused. Events go to agents through the notifier: `round`
(services/registry/plan.py), `abort`, `kill_worker`, `worker_suspected` (its
agent prints the suspect's stack), `job_finished`; and to operators:
`worker_hung`, `straggler`. Every pass and request reads the time
once (`Now`, from the service's clock).

The `waits` reports are judged as they arrive, not in a pass: the service's
`WaitBoard` keeps the round's latest reports in memory (only the calibration
of the hang limit is saved, with the job), and a report saves the job only
when it raised the calibration or queued an event.

Durable. The registry keeps the job in a `JobStore` (services/registry/store.py;
a SQLite database under `--state-dir`, chosen by services/registry/__main__.py),
saved at the end of every pass and request that changed it, before it answers
or publishes what the change caused; events wait in an outbox (saved
with the job) until the notifier takes them. A save the store refuses undoes
the change in memory (`_undo_unsaved`): the request is answered
`unavailable`, and its retry finds the registry as it was. A registry killed and started
again carries on with the same job, round and resets. The other services keep
nothing on disk, and the registry rebuilds them from what it saved and what it
reads: a discovery with a new incarnation is told the job's settings, the
drains and blacklists it had, and the hosts of the current round
(`restore`); a rendezvous behind the job's round is given that round back
(`restore_round`). While a restarted discovery is still hearing from the
agents (`settling`), the driver neither starts rounds nor judges hosts.
"""

from __future__ import annotations

import functools
from typing import Any

from elastic_control_plane.bus.client import ServiceError, Unreachable, incarnation_id
from elastic_control_plane.bus.config import Endpoints, Timing
from elastic_control_plane.bus.contract import Event
from elastic_control_plane.bus.outbox import Outbox, QueuedEvent
from elastic_control_plane.bus.roles import AGENT, OPERATOR
from elastic_control_plane.bus.service import Request, RequestError, Service, handles
from elastic_control_plane.job.spec import JobSpec, SpecError
from elastic_control_plane.services.registry import goodput, metrics
from elastic_control_plane.services.registry.driver import Driver
from elastic_control_plane.services.registry.exits import WorkerExit
from elastic_control_plane.services.registry.hang_limits import judged_limits
from elastic_control_plane.services.registry.hosts import discovery_settings, host_marks
from elastic_control_plane.services.registry.job import FAILED, RUNNING_JOB, Job, Now
from elastic_control_plane.services.registry.ledger import HANG
from elastic_control_plane.services.registry.peers import Pass, Peer, Read, Steps
from elastic_control_plane.services.registry.reports import PENDING
from elastic_control_plane.services.registry.store import JobStore, StoreError
from elastic_control_plane.services.registry.wait_rows import CommitReport, parse_commit, parse_waits
from elastic_control_plane.services.registry.waits import FRESH_HEARTBEATS, Seen, WaitBoard

RUN_ID_MAX = 128  # a submitter's name for its run (elasticctl run --attach)


class RegistryService(Service):
    name = "registry"

    def __init__(self, endpoint: str, peers: Endpoints, timing: Timing, store: JobStore, **kw: Any) -> None:
        super().__init__(endpoint, **kw)
        sender = incarnation_id(self.name)
        self.discovery, self.rendezvous = Peer(self, peers.discovery, sender), Peer(self, peers.rendezvous, sender)
        self.store = store
        self.lost_after = timing.lost_after
        self.outbox = Outbox(self, peers.notifier, sender, self.security)
        self.brief_hosts: dict[str, Any] = {}  # discovery's brief host list last read: asked again only when changed
        self.waits = WaitBoard(fresh_s=FRESH_HEARTBEATS * timing.heartbeat)
        self._take_saved(self.store.load())
        if self.job.job_id:
            job = self.job
            self.log.info(
                "job_recovered", job=job.job_id, state=job.state, round=job.round, resets=job.resets, store=store.where
            )
        self.outbox.flush()
        self.every(timing.driver_tick, self._tick)

    @property
    def job(self) -> Job:
        return self.driver.job

    def _now(self) -> Now:
        return Now.read(self.clock)

    def _take_saved(self, loaded: tuple[dict[str, Any], dict[str, Any]] | None) -> None:
        """Memory becomes what the store saved: the job, its driver, the events not yet published, the ids."""
        saved, parts = loaded if loaded is not None else ({}, {})
        self.outbox.restore(map(QueuedEvent.saved, saved.get("outbox", [])))
        self.last_job_id: int = saved.get("last_job_id", 0)
        self.discovery_incarnation: str | None = saved.get("discovery_incarnation")
        job = Job.from_saved(saved["job"], parts, self._now()) if saved else Job()
        self.driver = self._driver(job)
        metrics.job_state(job.state)

    def _driver(self, job: Job) -> Driver:
        """The driver of `job`; when a failure began, the others' waits tell (the goodput ledger's fault instant)."""
        stalled_for = functools.partial(self.waits.longest_wait, job)
        return Driver(job, self.discovery, self.rendezvous, self.outbox, self.log, self.lost_after, stalled_for)

    def _persist(self, now: Now) -> None:
        """Save what changed, in one transaction, then send the events it caused (`outbox.put` only queues them):
        nothing goes out that a restart could forget. The state is a small document (compared with the last one
        saved, so an unchanged one writes nothing); the parts that grow with the job are the changed ones only.

        Write, then apply: a save the store refuses takes memory back to what it last saved (`JobStore.last_saved`),
        so the change is forgotten as if never made, and a retry of the request finds the registry as it was (a
        submit refused for now is not `job_running` on its retry). A store that can then not even say what it saved
        stops the registry: started again, it carries on from the store."""
        saved = {
            "last_job_id": self.last_job_id,
            "discovery_incarnation": self.discovery_incarnation,
            "outbox": [list(event) for event in self.outbox.queued],
            "job": self.job.to_saved(now),
        }
        parts = self.job.unsaved_parts(now)
        try:
            self.store.save(saved, parts)
        except StoreError as exc:  # a disk or etcd that refuses, or the role lost: nothing is answered or published
            self.log.warning("not_saved", reason=str(exc), effect="the change is undone")
            self._undo_unsaved()
            raise RequestError("unavailable", str(exc)) from None
        self.job.saved(parts)
        self.outbox.flush()

    def _undo_unsaved(self) -> None:
        try:
            self._take_saved(self.store.last_saved())
        except StoreError as exc:
            self.log.error("store_unreadable", reason=str(exc), effect="the registry stops; restarted, it reloads")
            self.stop()

    # -- requests ------------------------------------------------------------------------------
    @handles("submit", roles=(OPERATOR,))
    def on_submit(self, request: Request) -> dict[str, Any]:
        run_id = request.body.get("run_id") or ""
        if not isinstance(run_id, str) or len(run_id) > RUN_ID_MAX:
            raise RequestError("bad_request", f"run_id must be a string of at most {RUN_ID_MAX} characters")
        if run_id and run_id == self.job.run_id:  # its submitter again: it follows the run, running or ended
            return {"job": self.job.job_id, "attached": True}
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
        now = self._now()
        self.last_job_id += 1
        job = Job.submitted(spec, self.last_job_id, now.local, run_id)
        job.reports.replaces(self.job.reports)  # the old job's rows go with the new job's first save
        self.driver = self._driver(job)
        self.discovery_incarnation = configured.get("incarnation")
        metrics.job_state(job.state)
        self.log.info("job_submitted", job=job.job_id, command=spec.command, min_np=spec.min_np, max_np=spec.max_np)
        self._persist(now)
        return {"job": job.job_id}

    @handles("cancel", roles=(OPERATOR,))
    def on_cancel(self, request: Request) -> dict[str, Any]:
        if self.job.active:
            now = self._now()
            self.driver.finish(FAILED, str(request.body.get("reason") or "cancelled"), 130, now.local)
            self._persist(now)
        return self.job.summary()

    @handles("job", roles=(AGENT, OPERATOR), replayable=True)
    def on_job(self, request: Request) -> dict[str, Any]:
        return {**self.job.summary(), "goodput": goodput.headline(self.job.ledger.totals(self._now().local))}

    @handles("ledger", roles=(OPERATOR,), replayable=True)
    def on_ledger(self, request: Request) -> dict[str, Any]:
        now = self._now()
        return {
            "job": self.job.job_id,
            "state": self.job.state,
            "goodput": self.job.ledger.view(now.local, now.as_wall),
        }

    @handles("status", roles=(OPERATOR,), replayable=True)
    def on_status(self, request: Request) -> dict[str, Any]:
        now = self._now()
        shown = self.job.ledger.view(now.local, now.as_wall)
        shown.pop("interruptions")  # elasticctl report shows them
        return {
            **self.job.summary(),
            "goodput": {**shown, "headline": goodput.headline(shown)},
            "workers": self.job.reports.status_rows(),
            "history": self.job.history[-20:],
            "waits": self.waits.summary(self.job, self._now().local),
            "quota_refused": self.driver.quota_refused,
        }

    @handles("worker_exited", roles=(AGENT,))
    def on_worker_exited(self, request: Request) -> dict[str, Any]:
        exited, now = WorkerExit.parse(request.body), self._now()
        recorded = self.driver.record_exit(exited, now.local)
        self._persist(now)
        return {"recorded": recorded}

    @handles("waits", roles=(AGENT,), replayable=True)
    def on_waits(self, request: Request) -> dict[str, Any]:
        host, rows = parse_waits(request.body)
        commit, now = parse_commit(request.body), self._now()
        seen = self.waits.note(self.job, host, rows, now.local)
        self._act_on_waits(seen, now.local)
        if commit is not None and self.job.active:
            self._note_commit(host, commit, now.local)
        if seen.job_changed or seen.suspects or seen.kills or seen.stragglers:
            self._persist(now)
        return seen.reply()

    def _note_commit(self, host: str, commit: CommitReport, now: float) -> None:
        """A host's newest commit, for the ledger's lost work and checkpointing."""
        ledger = self.job.ledger
        ledger.committed(now, commit.commit, commit.age_s)
        if commit.resumed_round and commit.resumed_age_s is not None:
            ledger.resumed(now, commit.resumed_round, commit.resumed_age_s)
        ledger.saved_commits(now, host, commit.saving_s, len(self.job.round_hosts))

    def _act_on_waits(self, seen: Seen, now: float) -> None:
        """Queue the suspects, kills and straggler events a `waits` report made; log and count them."""
        if seen.new_round:
            metrics.keep_hosts(host for host, _ in self.job.round_hosts)
        metrics.waited_for(seen.waited_for)
        metrics.hang_limit(None if seen.limits is None else seen.limits.limit_s)
        for suspect in seen.suspects:
            self.outbox.put(Event.WORKER_SUSPECTED, suspect)
            self.log.warning("worker_suspected", **suspect, round=self.job.round)
        for kill in seen.kills:
            self.outbox.put(Event.KILL_WORKER, kill.event)
            shown = {key: value for key, value in kill.event.items() if key != "dump_stack"}
            self.log.warning("worker_hung", **shown, rank=kill.rank, resent=not kill.first, round=self.job.round)
            if kill.first:
                metrics.hung_worker()
                host, reason = kill.event["host"], kill.event["reason"]
                self.job.ledger.fault(now, now - kill.waited_s, HANG, host, reason)
        for straggler in seen.stragglers:
            self.outbox.put(Event.STRAGGLER, straggler)
            self.log.warning("straggler", **straggler, round=self.job.round)

    # -- the driver's passes: read -> decide -> write ----------------------------------------------
    def _tick(self) -> None:
        if self.job.active and not (self.discovery.reading or self.rendezvous.reading):
            driver = self.driver
            Pass(
                self._pass(driver),
                wanted=lambda: self.driver is driver and driver.job.active,
                blind=lambda exc: self._blind(driver, exc),
                done=self._end_of_pass,
            )

    def _blind(self, driver: Driver, exc: Exception) -> None:
        """A pass could not read its peers: nothing can be decided meanwhile (an interruption is paused)."""
        driver.blind(exc)
        driver.job.ledger.control_plane(self._now().local, available=False)

    def _pass(self, driver: Driver) -> Steps:
        """One pass: read the host set and the rounds, act on them, and once every slot has reported read the
        hosts' snapshots and judge the round (after a blacklist, read whether any usable host is left)."""
        job = driver.job
        pending = job.state == RUNNING_JOB and job.reports.count(PENDING) > 0
        brief, rounds = yield [
            Read(self.discovery, "hosts", {"brief": True, "unless": self.brief_hosts.get("generation")}),
            Read(self.rendezvous, "status", driver.status_query(pids=pending)),
        ]
        if not brief.get("unchanged"):
            self.brief_hosts = brief
        hosts = self.brief_hosts
        now = self._now()
        try:
            reconciled = self._reconciled(hosts, rounds, now)
        except (Unreachable, ServiceError) as exc:
            driver.blind(exc)
            reconciled = False
        job.ledger.control_plane(now.local, available=reconciled)
        if not reconciled:
            return
        if not driver.drive(hosts, rounds, now.local):
            return
        (snapshots,) = yield [Read(self.discovery, "snapshots", {})]
        decision = driver.judge(snapshots, self._now().local)
        if decision.action == "resume" and decision.blacklist:
            (snapshots,) = yield [Read(self.discovery, "snapshots", {})]
            driver.fail_if_no_usable_host(snapshots, decision.reason, self._now().local)

    def _end_of_pass(self) -> None:
        """The pass's one write: the metrics and the store catch up with what it changed. A save the store refuses
        (an etcd that does not answer for a moment) has taken memory back to the last save (`_persist`): the pass is
        redone by the next tick from there, and whatever it announced (a round: its event is sent only once saved)
        is announced once, by the pass whose save lands; a round the rendezvous already made is asked for again by
        its number and given back as it is."""
        metrics.workers(self.job.reports.counts())
        limits = judged_limits(self.job)
        metrics.hang_limit(None if limits is None else limits.limit_s)
        now = self._now()
        metrics.goodput(self.job.ledger.totals(now.local))
        try:
            self._persist(now)
        except RequestError:
            metrics.pass_not_saved()

    def _reconciled(self, hosts: dict[str, Any], rounds: dict[str, Any], now: Now) -> bool:
        """Give a restarted discovery or rendezvous back what the job had; True when both agree with the job and
        discovery has heard from its agents (the driver may judge hosts and start rounds)."""
        job = self.job
        if hosts.get("incarnation") != self.discovery_incarnation:
            self.discovery.write(
                "restore",
                {**discovery_settings(self.driver.spec), "marks": job.host_marks, "expected": job.round_hosts},
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
        job.host_marks = host_marks(hosts, job.host_marks, now.wall)
        return True

    def close(self) -> None:
        try:
            self._persist(self._now())
        except RequestError as exc:  # a replica that lost its role, or etcd out of reach: the last save is not its
            self.log.warning("not_saved_on_close", reason=exc.message)
        for peer in (self.discovery, self.rendezvous):
            peer.close()
        self.store.close()
        super().close()
