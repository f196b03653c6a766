"""WorkerKeeper: the host's worker processes for the current job: start, reap, restart in place, standbys, stop.

It owns the host's slot book (agent/slots.py), the only place that changes it, and carries out the book's decisions:
- each slot of this host in the latest round that has no live process gets one: a waiting standby, or a new
  process (`take_round`), started by agent/launcher.py, held back while the fork server imports;
- every exit is reported at once (agent/reports.py); a worker killed by a signal after its script ended died in
  the interpreter's teardown, after its work: reported as such, never restarted;
- a crash restarts the slot in place: the slot is reported down to discovery first (so the survivors re-form
  without it at once) and up again when its replacement waits in `init()`; a waiting standby takes the slot at
  once and the slot never goes down; a slot given up is up again once the registry has the report, so its host
  comes back whole after its cooldown;
- with `--standby N`, N spare processes wait in `init()` while a job runs; one that dies is replaced with the
  slots' back-off, and standbys that keep dying are given up for the job; without `--standby`, one standby is
  kept where the fork server serves the job;
- warm-up: a host joining a running job starts a process for every slot, warm once they all wait for a round;
- `stop_all` signals every worker; after SIGTERM, `escalate_stops` SIGKILLs those alive after the grace.
A worker lives in one place: its slot (`workers`) or the standby pool; its record is on it (agent/workers.py).
The agent calls `reap_workers` after SIGCHLD; `restart_due_slots`, `start_held_back` and `escalate_stops` every tick.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from elastic_control_plane.agent.discovery_link import DiscoveryLink
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.launcher import Launcher
from elastic_control_plane.agent.reports import ExitReports
from elastic_control_plane.agent.restarts import RestartPolicy
from elastic_control_plane.agent.slots import Remedy, SlotBook
from elastic_control_plane.agent.standbys import StandbyPool, standbys_wanted
from elastic_control_plane.agent.workers import STANDBY, HostSettings, Worker, reap
from elastic_control_plane.bus.service import Request
from elastic_control_plane.job.assignments import SlotInfo, slots_of
from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.slot_processes.agent_link import lineage
from elastic_control_plane.slot_processes.forking import reap_orphans


@dataclass(frozen=True)
class KeeperConfig:
    """What the keeper is told of its host: what its workers are told, its slots, and the standbys asked for
    (`--standby`; None: the default)."""

    settings: HostSettings
    slots: int
    standby: int | None


class WorkerKeeper:
    def __init__(
        self,
        config: KeeperConfig,
        *,
        launcher: Launcher,
        link: DiscoveryLink,
        reports: ExitReports,
        on_exited: Callable[[Worker], None],
        on_warm: Callable[[], None],
        log: Any,
    ) -> None:
        self.config, self.host = config, config.settings.host
        self.launcher, self.link, self.reports = launcher, link, reports
        self.on_exited, self.on_warm, self.log = on_exited, on_warm, log
        self.book = SlotBook(time.monotonic)
        self.workers: dict[int, Worker] = {}
        self.standbys = StandbyPool()
        self.plan: JobPlan | None = None
        self.latest_round: dict[str, Any] | None = None
        self.held_back: dict[int, SlotInfo | None] = {}
        self._kill_at: float | None = None

    # -- the job -----------------------------------------------------------------------------------
    def adopt_job(self, plan: JobPlan) -> None:
        """The job to run workers for: its command, environment and restart policy; a new job starts with no crashes."""
        new_job = self.plan is None or plan.job != self.plan.job
        self.launcher.adopt_job(plan, new_job)
        self.plan = plan
        self.book.start_job(RestartPolicy.of_plan(plan), new_job)
        self._keep_standbys()

    def take_round(self, plan: JobPlan, round_body: dict[str, Any]) -> None:
        """A round formed: its job adopted, and each slot of this host in it given a process."""
        self.latest_round = round_body
        self.adopt_job(plan)
        self.ensure_workers()

    def warm_up(self, plan: JobPlan) -> None:
        """A host joining a running job: a process for every slot, ahead of any round; warm once they all wait."""
        self.adopt_job(plan)
        self.book.begin_warm_up(self.config.slots, INTERVALS.warm_up_limit)
        self.log.info("warming_up", job=plan.job, slots=self.config.slots)
        for local_rank in range(self.config.slots):
            self._start(local_rank, plan, None)

    def warm_up_expired(self) -> set[int]:
        """The slots still warming once the warm-up limit has passed (given up on); empty otherwise."""
        return self.book.warm_up_expired()

    def end_job(self) -> None:
        """The job finished: no more restarts or standbys, every slot up, every process stopped."""
        self.plan = None
        self.latest_round = None
        self.held_back.clear()
        self.launcher.end_job(flush=self.draining)
        self.book.end_job()
        self.set_down(frozenset())
        self.standbys.signal_all(signal.SIGTERM)
        if self.workers:
            self.stop_all(signal.SIGTERM)

    def host_lost(self) -> None:
        """Discovery declared this host lost: its workers are stopped before it registers afresh."""
        self.log.warning("host_declared_lost", workers=len(self.workers))
        self.latest_round = None
        self.held_back.clear()
        self.book.host_lost()
        self.stop_all(signal.SIGKILL)

    def ensure_workers(self) -> None:
        """Give each slot of this host in the latest round that has no live process one: a standby, or a new process."""
        if not self.book.may_start_worker() or self.plan is None or self.latest_round is None:
            return
        for slot in slots_of(self.latest_round.get("hosts", []), self.host):
            if slot.local_rank not in self.workers:
                self.book.filled(slot.local_rank)
                self._fill(slot.local_rank, slot)

    # -- what the workers tell the agent -------------------------------------------------------------
    def slot_asks_rank(self, local_rank: int) -> None:
        """The slot's process asks for its place in a round: it is warm, and its slot up."""
        self._warmed(local_rank)
        self.slot_ready(local_rank)

    def slot_entered(self, local_rank: int) -> None:
        self.book.slot_entered(local_rank)

    def script_ended(self, pid: int, uncaught_exception: bool) -> None:
        worker = self.find(pid)
        if worker is not None:
            worker.script_ended, worker.uncaught_exception = True, uncaught_exception

    def processes(self) -> list[Worker]:
        """Every worker process of the host: the slots', then the standbys."""
        return [*self.workers.values(), *self.standbys.processes.values()]

    def find(self, pid: int) -> Worker | None:
        """The worker or standby whose process is `pid` or its ancestor (a user's `sh -c` that does not exec)."""
        by_pid = {worker.pid: worker for worker in self.processes()}
        return next((by_pid[p] for p in lineage(pid) if p in by_pid), None)

    def command_failed(self, local_rank: int, pid: int, code: int) -> bool:
        """A torchrun-mode slot's command failed: reported as a worker restarted in place while its supervisor, the
        slot's process, lives on; False when `pid` is not the slot's process."""
        worker = self.workers.get(local_rank)
        if worker is None or worker.pid != pid:
            return False
        self.log.warning("command_failed", local_rank=local_rank, pid=pid, exit_code=code)
        self.reports.worker_exited(local_rank, pid, code, process_lives=True, restarting=True)
        return True

    def park_standby(self, pid: int, request: Request) -> bool:
        """A standby waits in `init()` for a slot (its request parked, answered with the slot); it takes a crashed
        slot waiting out its back-off at once. False when `pid` is not a standby of this host."""
        if pid not in self.standbys.processes:
            return False
        self.standbys.park(pid, request)
        self.log.info("standby_waiting", pid=pid)
        for local_rank in self.book.restarting():
            if self.admit_standby(local_rank):
                break
        return True

    # -- the loop's steps ----------------------------------------------------------------------------
    def reap_workers(self, others: Collection[int] = ()) -> None:
        """After SIGCHLD: exited workers reported, crashed slots restarted in place, dead standbys replaced, slots
        stopped on request given a process again; the children in `others` are their owners' to wait for."""
        killed_on_request = False
        for worker, code in reap(self.workers):
            self.book.slot_left(worker.local_rank)
            self.on_exited(worker)
            self._warmed(worker.local_rank)
            self.log.info(
                "worker_exited",
                local_rank=worker.local_rank,
                pid=worker.pid,
                exit_code=code,
                after_script_end=worker.script_ended,
                after_job_end=self.plan is None,
            )
            if worker.died_after_its_script(code):
                self.log.warning(
                    "worker_died_after_its_script_ended", local_rank=worker.local_rank, pid=worker.pid, signal=-code
                )
                self.reports.worker_exited(worker.local_rank, worker.pid, code, after_script_end=True, **worker.hang)
            elif self.book.is_crash(code, worker.stop_requested):
                self._restart_in_place(worker, code)
            else:
                self.reports.worker_exited(worker.local_rank, worker.pid, code, **worker.hang)
            killed_on_request |= worker.stop_requested
        for standby, code in self.standbys.reap():
            self.on_exited(standby)
            if not standby.stop_requested and self.book.may_start_worker():
                self._replace_standby(code)
        fork_server = self.launcher.children_exited()
        reap_orphans({*(w.pid for w in self.processes()), *fork_server, *others})
        if killed_on_request:
            self.ensure_workers()

    def restart_due_slots(self) -> None:
        """Crashed slots (and the standby pool) whose back-off has ended get a process: a standby, or a new one."""
        for local_rank in self.book.due():
            if local_rank == STANDBY:
                self._keep_standbys()
            else:
                self._fill(local_rank, None)

    def start_held_back(self) -> None:
        """The fork server is ready (or given up on): start the processes held back for it."""
        if not self.held_back or self.plan is None or self.launcher.holds_back():
            return
        held, self.held_back = self.held_back, {}
        for local_rank, slot in held.items():
            if local_rank != STANDBY:
                self._fill(local_rank, slot)
        self._keep_standbys()

    def escalate_stops(self) -> None:
        """SIGKILL for the workers still alive once the grace after SIGTERM has passed."""
        if self._kill_at is not None and time.monotonic() >= self._kill_at:
            self._kill_at = None
            for worker in self.workers.values():
                worker.signal(signal.SIGKILL)

    # -- processes -------------------------------------------------------------------------------
    def _fill(self, local_rank: int, slot: SlotInfo | None) -> None:
        """Give a slot of the job that has no process one: the longest-waiting standby, or a new process."""
        if self.plan is None or not self.book.may_start_worker() or local_rank in self.workers:
            return
        if not self.admit_standby(local_rank):
            self._start(local_rank, self.plan, slot)

    def _start(self, local_rank: int, plan: JobPlan, slot: SlotInfo | None) -> None:
        """Start the process of `local_rank` (STANDBY: a spare) into `slot` (None: ahead of a round); held back while
        the fork server imports (`start_held_back`); a default standby only where the fork server makes it cheap."""
        if self.launcher.holds_back():
            self.held_back[local_rank] = slot
            return
        try:
            worker = self.launcher.start(
                local_rank, plan, slot, may_spawn=local_rank != STANDBY or self.config.standby is not None
            )
        except OSError as exc:
            self.log.error("spawn_failed", local_rank=local_rank, reason=str(exc))
            if local_rank != STANDBY:
                self.reports.worker_exited(local_rank, -1, 127)
            return
        if worker is None:
            return
        if local_rank == STANDBY:
            self.standbys.add(worker)
        else:
            self.workers[local_rank] = worker

    def _warmed(self, local_rank: int) -> None:
        if self.book.warmed(local_rank):
            self.on_warm()

    # -- crashes: restart in place ---------------------------------------------------------------
    def _restart_in_place(self, worker: Worker, code: int) -> None:
        """Carry out the book's verdict on a crash: give the slot up, hand it to a standby, or take it down until its
        replacement starts after the back-off."""
        local_rank, pid, hang = worker.local_rank, worker.pid, worker.hang
        verdict = self.book.crashed(local_rank, standby_waiting=bool(self.standbys.waiting))
        if verdict.remedy is Remedy.GIVE_UP:
            self.log.warning("slot_given_up", local_rank=local_rank, pid=pid, exit_code=code, reason=verdict.reason)
            # Up again only once the registry has the report (it blacklists the host at the round's decision): a
            # slot left down would keep the host out of every round for good.
            self.reports.worker_exited(
                local_rank,
                pid,
                code,
                then=lambda: self.set_down(self.book.down - {local_rank}),
                restarting=False,
                gave_up=verdict.reason,
                **hang,
            )
        elif verdict.remedy is Remedy.TAKE_STANDBY:
            self.admit_standby(local_rank)
            self.reports.worker_exited(local_rank, pid, code, restarting=True, **hang)
        else:
            self.log.info("slot_restarting", local_rank=local_rank, pid=pid, exit_code=code, delay_s=verdict.delay)
            self.set_down(
                self.book.down | {local_rank},
                then=lambda: self.reports.worker_exited(local_rank, pid, code, restarting=True, **hang),
            )

    def set_down(self, down: frozenset[int], then: Any = None) -> None:
        """Tell discovery which slots are down; `then` runs once discovery has it (or could not be reached)."""
        if self.book.set_down(down):
            self.link.report_down(then)
        elif then is not None:
            then()

    def slot_ready(self, local_rank: int) -> None:
        """The slot's process waits in `init()`: the slot is up again; it enters a round by the host-update path."""
        if local_rank in self.book.down:
            self.log.info("slot_ready", local_rank=local_rank)
            self.set_down(self.book.down - {local_rank})

    # -- standbys: spare processes waiting in init() -----------------------------------------------
    def _keep_standbys(self) -> None:
        """Start standbys until `--standby` of them exist (while a job runs and the host is not draining)."""
        if self.plan is None or not self.book.may_keep_standbys():
            return
        for _ in range(standbys_wanted(self.config.standby, self.plan) - len(self.standbys)):
            self._start(STANDBY, self.plan, None)

    def _replace_standby(self, code: int) -> None:
        """A standby died while waiting: replaced silently (with the slots' back-off, so a script that dies at
        start-up does not spin); one that keeps dying is given up for this job."""
        delay = self.book.standby_died()
        if delay is None:
            self.log.warning(
                "standbys_given_up",
                exit_code=code,
                crashes=self.book.crashes.count(STANDBY),
                window_s=self.book.policy.window,
            )
        else:
            self.log.info("standby_replaced", exit_code=code, delay_s=delay)

    def admit_standby(self, local_rank: int) -> bool:
        """Hand the slot `local_rank` (which has no process) to the longest-waiting standby, if one waits."""
        if local_rank in self.workers:
            return False
        taken = self.standbys.take()
        if taken is None:
            return False
        worker, request = taken
        worker.local_rank = local_rank
        self.launcher.relabel(worker)
        self.workers[local_rank] = worker
        self.book.filled(local_rank)
        request.reply({"local_rank": local_rank})
        self.log.info("standby_admitted", local_rank=local_rank, pid=worker.pid)
        self.slot_ready(local_rank)
        self._keep_standbys()
        return True

    def stop_all(self, sig: int) -> None:
        """Signal every worker; after SIGTERM, `escalate_stops` sends SIGKILL to those still alive after the grace."""
        for worker in self.workers.values():
            worker.stop_requested = True
            worker.signal(sig)
        if sig != signal.SIGKILL and self.workers:
            self._kill_at = time.monotonic() + INTERVALS.stop_grace

    @property
    def stopping(self) -> bool:
        """SIGTERM was sent and SIGKILL follows after the grace."""
        return self._kill_at is not None

    # -- draining and exit ---------------------------------------------------------------------------
    def begin_drain(self) -> bool:
        """The host drains: standbys stop now, and the workers that have not entered a round (those in a round leave at
        their next commit). False when it already drains (a second SIGTERM: stop now)."""
        if not self.book.begin_drain():
            return False
        self.standbys.signal_all(signal.SIGTERM)
        for local_rank, worker in self.workers.items():
            if local_rank not in self.book.entered:
                worker.stop_requested = True
                worker.signal(signal.SIGTERM)
        return True

    @property
    def draining(self) -> bool:
        return self.book.draining

    def drain_overdue(self, timeout: float) -> bool:
        return self.book.drain_overdue(timeout)

    def stop_everything(self) -> None:
        """The agent exits: every worker and standby is killed and waited for, and the fork server stopped."""
        self.launcher.close()
        self.stop_all(signal.SIGKILL)
        self.standbys.signal_all(signal.SIGKILL)
        for worker in self.processes():
            worker.process.wait()
        self.reap_workers()

    # -- what discovery is told -------------------------------------------------------------------
    def slots_down(self) -> dict[str, Any]:
        """The slots reported down to discovery, with the version that orders those reports."""
        return {"down": sorted(self.book.down), "down_version": self.book.down_version}
