"""WorkerKeeper: the host's worker processes for the current job: start, reap, restart in place, standbys, stop.

It carries out the slot book's decisions (agent/slots.py) on real processes:
- each slot of this host in the latest round that has no live process gets
  one: a waiting standby, or a new process (`ensure_workers`);
- every exit is reported to the registry at once; a worker killed by a signal
  after its script ended died in the interpreter's teardown, after its work:
  reported as such, never restarted;
- a crash restarts the slot in place: the slot is reported down to discovery
  first (so the survivors re-form without it at once) and up again when its
  replacement waits in `init()`; a waiting standby takes the slot at once and
  the slot never goes down; a slot given up is up again once the registry
  has the report, so its host comes back whole after its cooldown;
- with `--standby N`, N spare processes wait in `init()` while a job runs;
  one that dies is replaced with the slots' back-off, and standbys that keep
  dying are given up for the job;
- every process is forked from the host's fork server where it serves the
  job (agent/fork_server.py), else spawned, and the job's output says so once
  with the reason (`[host] workers start as fresh interpreters ...: REASON`);
  while the fork server imports, starts are held back until it is ready
  (`start_held_back`); without `--standby`, one standby is kept where the fork
  server serves the job;
- `stop_all` signals every worker; after SIGTERM, `escalate` sends SIGKILL
  to those still alive after the grace.
Each worker's output is forwarded with a `[host:slot]` prefix.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from agent.fork_choice import Key, forked_argv, key_of, own_key
from agent.fork_server import SPAWN_COST, ForkServer
from agent.link import DiscoveryLink
from agent.output import PrefixedPipe
from agent.restarts import RestartPolicy
from agent.slots import Remedy, SlotBook
from agent.snapshots import SnapshotKeeper
from agent.standbys import StandbyPool
from agent.workers import STANDBY, HostSettings, Worker, reap, reap_orphans, spawn, worker_command, worker_env
from bus.assignments import SlotInfo, slots_of
from bus.client import AsyncClient
from bus.config import Timing
from bus.contract import JobPlan
from bus.service import Service

STOP_GRACE = 5.0
DEFAULT_FORKED_STANDBYS = 1  # without --standby: one per host where the fork server runs (none where it does not,
# nor in torchrun mode, where a crashed command's supervisor lives on and forks the next round's)


class WorkerKeeper:
    def __init__(
        self,
        service: Service,
        settings: HostSettings,
        timing: Timing,
        standby: int | None,
        book: SlotBook,
        link: DiscoveryLink,
        snapshots: SnapshotKeeper,
        fork_server: ForkServer,
        registry: AsyncClient,
        rendezvous: AsyncClient,
        on_exited: Callable[[Worker], None],
        log: Any,
    ) -> None:
        self.service, self.settings, self.timing, self.standby = service, settings, timing, standby
        self.host = settings.host
        self.book, self.link, self.snapshots, self.fork_server = book, link, snapshots, fork_server
        self.registry, self.rendezvous = registry, rendezvous
        self.on_exited, self.log = on_exited, log
        self.workers: dict[int, Worker] = {}
        self.standbys = StandbyPool()
        self.plan: JobPlan | None = None
        self.held_back: dict[int, SlotInfo | None] = {}
        self.fork_key: Key | None = None
        self.fork_why_not = ""
        self.said_spawning = False
        self.latest_round: dict[str, Any] | None = None
        self._kill_at: float | None = None

    def end_job(self) -> None:
        """The job finished: no more restarts or standbys, every slot up, every process stopped."""
        self.plan = None
        self.latest_round = None
        self.held_back.clear()
        if self.fork_server.zygote is None:
            self.fork_server.prepare(own_key())  # the job's could not serve: ready the agent's own for the next
        self.book.end_job()
        self.set_down(frozenset())
        self.standbys.signal_all(signal.SIGTERM)
        if self.workers:
            self.stop_all(signal.SIGTERM)

    def host_lost(self) -> None:
        self.latest_round = None
        self.held_back.clear()
        self.book.host_lost()
        self.stop_all(signal.SIGKILL)

    def stop_everything(self) -> None:
        """The agent exits: every worker and standby is killed and waited for, and the fork server stopped."""
        self.fork_server.close()
        self.stop_all(signal.SIGKILL)
        self.standbys.signal_all(signal.SIGKILL)
        for worker in [*self.workers.values(), *self.standbys.processes.values()]:
            worker.process.wait()
        self.reap()

    def drain(self) -> None:
        """The host drains: standbys stop now, and the workers that have not joined a round (those in a round leave at
        their next commit)."""
        self.standbys.signal_all(signal.SIGTERM)
        for local_rank, worker in self.workers.items():
            if local_rank not in self.book.joined:
                worker.stop_requested = True
                worker.signal(signal.SIGTERM)

    def start_warming(self, slots: int) -> None:
        """A host joining a running job: a process for every slot, ahead of any round."""
        assert self.plan is not None
        for local_rank in range(slots):
            self._spawn(local_rank, self.plan, None)

    def adopt_job(self, plan: JobPlan) -> None:
        """The job to run workers for: its command, environment and restart policy; a new job starts with no crashes."""
        new_job = self.plan is None or plan.job != self.plan.job
        if new_job:
            self.snapshots.start_job(plan)
            self.fork_server.new_job()
            self.said_spawning = False
        self.fork_key, self.fork_why_not = key_of(plan, os.environ)
        self.fork_server.prepare(self.fork_key)
        self.plan = plan
        self._say_if_spawning()
        self.book.start_job(RestartPolicy.of_plan(plan), new_job)
        self._keep_standbys()

    def ensure_workers(self) -> None:
        """Give each slot of this host in the latest round that has no live process one: a standby, or a new process."""
        if not self.book.may_start_worker() or self.plan is None or self.latest_round is None:
            return
        for slot in slots_of(self.latest_round.get("hosts", []), self.host):
            if slot.local_rank not in self.workers:
                self.book.restart_at.pop(slot.local_rank, None)
                if not self.admit_standby(slot.local_rank):
                    self._spawn(slot.local_rank, self.plan, slot)

    def kill_hung(self, body: dict[str, Any]) -> None:
        worker = self.workers.get(body.get("local_rank", -1))
        if body.get("host") == self.host and worker is not None and body.get("pid") in (None, worker.pid):
            self.log.warning(
                "killing_worker", local_rank=worker.local_rank, pid=worker.pid, reason="registry declared it hung"
            )
            worker.stop_requested = True
            worker.signal(signal.SIGKILL)

    # -- processes -------------------------------------------------------------------------------
    def _spawn(self, local_rank: int, plan: JobPlan, slot: SlotInfo | None) -> None:
        """Start the worker of `local_rank` (STANDBY: a spare that waits in `init()` for a slot): forked from the fork
        server, or spawned; `slot` is its assignment in the round, None when it starts ahead of one. While the fork
        server imports, the start is held back until it is ready (`start_held_back`)."""
        if self.fork_server.starting(self.fork_key):
            self.held_back[local_rank] = slot
            return
        env = worker_env(os.environ, plan, self.settings, local_rank, slot, self.snapshots.worker_env())
        argv = forked_argv(plan)
        forked = None if argv is None else self.fork_server.fork(self.fork_key, [plan.command[0], *argv], env, plan.cwd)
        if forked is None:
            self._say_if_spawning()
            if local_rank == STANDBY and self.standby is None:
                return  # a default standby is one the fork server makes nearly free; none without it
        try:
            worker = Worker(local_rank, forked or spawn(worker_command(plan), env, plan.cwd), forked=forked is not None)
        except OSError as exc:
            self.log.error("spawn_failed", local_rank=local_rank, reason=str(exc))
            if local_rank != STANDBY:
                self.report_exit(local_rank, -1, 127)
            return
        if local_rank == STANDBY:
            self.standbys.add(worker)
        else:
            self.workers[local_rank] = worker
        for stream, sink in ((worker.process.stdout, sys.stdout.buffer), (worker.process.stderr, sys.stderr.buffer)):
            assert stream is not None
            pipe = PrefixedPipe(os.dup(stream.fileno()), self._output_prefix(worker), sink)
            worker.output.append(pipe)
            self._follow_output(pipe)
            stream.close()
        if local_rank == STANDBY:
            self.log.info("standby_started", pid=worker.pid, forked=worker.forked)
        else:
            self.log.info(
                "worker_started",
                local_rank=local_rank,
                rank=None if slot is None else slot.rank,
                pid=worker.pid,
                warming=slot is None,
                forked=worker.forked,
            )

    def start_held_back(self) -> None:
        """The fork server is ready (or given up on): start the processes held back for it."""
        if not self.held_back or self.plan is None or self.fork_server.starting(self.fork_key):
            return
        held, self.held_back = self.held_back, {}
        for local_rank, slot in held.items():
            if (
                local_rank != STANDBY
                and local_rank not in self.workers
                and self.book.may_start_worker()
                and not self.admit_standby(local_rank)
            ):
                self._spawn(local_rank, self.plan, slot)
        self._keep_standbys()

    def fork_server_availability(self) -> dict[str, str]:
        """The host's fork server as `elasticctl status` shows it: for the job's workers, or between jobs for the
        zygote the agent keeps (the last job's, else its own interpreter's)."""
        if self.plan is not None:
            return self.fork_server.availability(self.fork_key, self.fork_why_not)
        zygote = self.fork_server.zygote
        return self.fork_server.availability(own_key() if zygote is None else zygote.key, "")

    def _say_if_spawning(self) -> None:
        """Once per job: the job's output says this host spawns its workers, why, and what that costs."""
        if self.plan is None or self.said_spawning:
            return
        availability = self.fork_server.availability(self.fork_key, self.fork_why_not)
        if availability["state"] in ("unavailable", "off"):
            self.said_spawning = True
            sys.stdout.write(f"[{self.host}] {SPAWN_COST}: {availability['reason']}\n")
            sys.stdout.flush()

    def _output_prefix(self, worker: Worker) -> str:
        return f"[{self.host}:{'standby' if worker.local_rank == STANDBY else worker.local_rank}] "

    def _follow_output(self, pipe: PrefixedPipe) -> None:
        def on_readable() -> None:
            if not pipe.pump():
                self.service.unwatch(pipe.fd)

        self.service.watch(pipe.fd, on_readable)

    def reap(self) -> None:
        killed_on_request = False
        for worker, code in reap(self.workers):
            self.book.joined.discard(worker.local_rank)
            self.on_exited(worker)
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
                self.report_exit(worker.local_rank, worker.pid, code, after_script_end=True)
            elif self.book.is_crash(code, worker.stop_requested):
                self._restart_in_place(worker, code)
            else:
                self.report_exit(worker.local_rank, worker.pid, code)
            killed_on_request |= worker.stop_requested
        for standby, code in self.standbys.reap():
            self.on_exited(standby)
            if not standby.stop_requested and self.book.may_start_worker():
                self._replace_standby(code)
        self.fork_server.check()
        self._say_if_spawning()
        reap_orphans({*(w.pid for w in self.workers.values()), *self.standbys.processes, *self.fork_server.pids()})
        if killed_on_request:
            self.ensure_workers()

    def report_exit(
        self, local_rank: int, pid: int, code: int, then: Any = None, process_lives: bool = False, **verdict: Any
    ) -> None:
        """Tell the registry a worker exited; `then` runs once the registry has it (or could not be reached).
        `process_lives`: a torchrun-mode slot's command failed and its supervisor, the slot's process, joins the next
        round (the rendezvous keeps its join)."""
        slot = {"host": self.host, "local_rank": local_rank, "pid": pid}
        newest = self.snapshots.newest()
        verdict["snapshot_commit"] = newest.commit if newest is not None else 0
        self.registry.send(
            "worker_exited",
            {**slot, "exit_code": code, **verdict},
            on_reply=lambda _: then and then(),
            on_timeout=then,
            timeout=self.timing.request_timeout,
            deadline=300.0,
        )
        if not process_lives:
            self.rendezvous.send("forget", slot, timeout=self.timing.request_timeout, deadline=60.0)

    # -- crashes: restart in place ---------------------------------------------------------------
    def _restart_in_place(self, worker: Worker, code: int) -> None:
        """Carry out the book's verdict on a crash: give the slot up, hand it to a standby, or take it down until its
        replacement starts after the back-off."""
        local_rank, pid = worker.local_rank, worker.pid
        verdict = self.book.crashed(local_rank, standby_waiting=bool(self.standbys.waiting))
        if verdict.remedy is Remedy.GIVE_UP:
            self.log.warning("slot_given_up", local_rank=local_rank, pid=pid, exit_code=code, reason=verdict.reason)
            # Up again only once the registry has the report (it blacklists the host at the round's decision): a
            # slot left down would keep the host out of every round for good.
            self.report_exit(
                local_rank,
                pid,
                code,
                then=lambda: self.set_down(self.book.down - {local_rank}),
                restarting=False,
                gave_up=verdict.reason,
            )
        elif verdict.remedy is Remedy.TAKE_STANDBY:
            self.admit_standby(local_rank)
            self.report_exit(local_rank, pid, code, restarting=True)
        else:
            self.log.info("slot_restarting", local_rank=local_rank, pid=pid, exit_code=code, delay_s=verdict.delay)
            self.set_down(
                self.book.down | {local_rank}, then=lambda: self.report_exit(local_rank, pid, code, restarting=True)
            )

    def set_down(self, down: frozenset[int], then: Any = None) -> None:
        """Tell discovery which slots are down; `then` runs once discovery has it (or could not be reached)."""
        if self.book.set_down(down):
            self.link.report_down(then)
        elif then is not None:
            then()

    def slot_ready(self, local_rank: int) -> None:
        """The slot's process waits in `init()`: the slot is up again, and joins through the host-update path."""
        if local_rank in self.book.down:
            self.log.info("slot_ready", local_rank=local_rank)
            self.set_down(self.book.down - {local_rank})

    def restart_due(self) -> None:
        for local_rank in self.book.due():
            if local_rank == STANDBY:
                self._keep_standbys()
            elif (
                self.plan is not None
                and self.book.may_start_worker()
                and local_rank not in self.workers
                and not self.admit_standby(local_rank)
            ):
                self._spawn(local_rank, self.plan, None)

    # -- standbys: spare processes waiting in init() -----------------------------------------------
    def _keep_standbys(self) -> None:
        """Start standbys until `--standby` of them exist (while a job runs and the host is not draining)."""
        if self.plan is None or not self.book.may_keep_standbys():
            return
        wanted = (
            self.standby if self.standby is not None else 0 if self.plan.mode == "torchrun" else DEFAULT_FORKED_STANDBYS
        )
        for _ in range(wanted - len(self.standbys)):
            self._spawn(STANDBY, self.plan, None)

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
        for pipe in worker.output:
            pipe.prefix = self._output_prefix(worker).encode()
        self.workers[local_rank] = worker
        self.book.restart_at.pop(local_rank, None)
        request.reply({"local_rank": local_rank})
        self.log.info("standby_admitted", local_rank=local_rank, pid=worker.pid)
        self.slot_ready(local_rank)
        self._keep_standbys()
        return True

    def stop_all(self, sig: int) -> None:
        """Signal every worker; after SIGTERM, `_escalate` sends SIGKILL to those still alive after the grace."""
        for worker in self.workers.values():
            worker.stop_requested = True
            worker.signal(sig)
        if sig != signal.SIGKILL and self.workers:
            self._kill_at = time.monotonic() + STOP_GRACE

    @property
    def stopping(self) -> bool:
        """SIGTERM was sent and SIGKILL follows after the grace."""
        return self._kill_at is not None

    def escalate(self) -> None:
        if self._kill_at is not None and time.monotonic() >= self._kill_at:
            self._kill_at = None
            for worker in self.workers.values():
                worker.signal(signal.SIGKILL)
