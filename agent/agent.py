"""AgentService: the control plane's hands on one host.

- registers with discovery and heartbeats (Paranoid Pirate: a reply of
  `unknown` means register again, `lost` means the host was declared lost, so
  its workers are stopped first); an unreachable control plane leaves the
  workers running while the agent keeps trying;
- follows the notifier's events: `round` spawns the workers of this host's
  slots that have no live process; `hosts_updated` and `abort` are relayed to
  the workers; `kill_worker` and `job_finished` stop them;
- serves its workers on an owner-only ipc socket: their rendezvous and store
  requests are forwarded with this host's name stamped on them, and each
  worker's event channel (`subscribe`) receives the relayed events;
- reports every worker exit at once (SIGCHLD) to the registry; a worker
  that told it its script ended (`script_ended`, sent by libworker at exit)
  and was then killed by a signal died in the interpreter's teardown, after
  its work: that is reported as such, never restarted;
- gives a slot up after too many crashes (its host is blacklisted) and puts
  it up again once the registry has the report, so the host comes back whole
  after its cooldown;
- owns the host's snapshot of the job's committed state (agent/snapshots.py):
  creates it for each job, reports its commit counter with every heartbeat
  and worker exit, flushes it to `--checkpoint-dir`, removes it at job end;
- restarts a crashed worker's slot in place (agent/restarts.py): the slot is
  reported down to discovery first, so the survivors re-form without it at
  once, and up again when its replacement waits in `init()`; with
  `--standby N` a spare process already waiting in `init()` takes the slot
  and the slot never goes down;
- on SIGTERM drains its own host: workers leave at their next commit, then
  the agent unregisters and exits;
- joining a running job, it starts its workers first and reports itself warm
  (available) only when they all wait for a round, so the job's running
  workers are not held up by process start-up;
- keeps its metrics (bus/metrics.py serves them): its workers by state, set
  every second from the loop, and the seconds each commit of the host's
  snapshot writer took, which the writer reports (`committed`, one-way).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import Gauge, Histogram

from bus.assignments import SlotInfo, round_environment, slots_of
from bus.client import AsyncClient, incarnation_id
from bus.config import Endpoints, Timing, unresolved_hosts
from bus.envelope import Message
from bus.pubsub import Subscription
from bus.reachability import Reachability
from bus.service import DEFERRED, Request, RequestError, Service, field, handles
from bus.sockets import Security
from agent.output import PrefixedPipe
from agent.restarts import CrashHistory, RestartPolicy, give_up_reason
from agent.snapshots import SnapshotKeeper
from agent.workers import STANDBY, Worker, reap, spawn

FORWARDED = ("rank_and_size", "kv_set", "kv_get")
PARKED = ("rank_and_size", "kv_get")
RELAYED_EVENTS = ("hosts_updated", "abort")
STOP_GRACE = 5.0
WARM_UP_LIMIT = 120.0
SLOT_REPORT_DEADLINE = 1.0
METRICS_INTERVAL = 1.0
WORKER_STATES = ("running", "starting", "stopping", "standby", "restarting")
WORKERS_BY_STATE = Gauge(
    "elastic_agent_workers",
    "Worker processes of this host by state (set every second): running (joined a round), starting (started, not "
    "joined yet), stopping (signalled by the agent), standby (spare), restarting (crashed slot waiting out its back-off).",
    ["host", "state"],
)
COMMIT_SECONDS = Histogram(
    "elastic_commit_seconds",
    "Seconds the host's snapshot writer took to save a commit (copy and snapshot write), as it reports them.",
    ["host"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)


def agent_endpoint(run_dir: Path, host: str) -> str:
    return f"ipc://{run_dir}/agent-{host}.sock"


class AgentService(Service):
    name = "agent"

    def __init__(
        self,
        host: str,
        slots: int,
        control: Endpoints,
        timing: Timing,
        *,
        run_dir: Path,
        security: Security = Security(),
        drain_timeout: float = 60.0,
        advertise_address: str = "127.0.0.1",
        share_gpus: bool = False,
        standby: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__(agent_endpoint(run_dir, host), security=security, **kw)
        self.host, self.slots, self.timing = host, slots, timing
        self.drain_timeout = drain_timeout
        self.advertise_address = advertise_address
        self.share_gpus = share_gpus
        self.standby = standby
        self.incarnation = incarnation_id("agent", host)
        self.sender_id = self.incarnation
        self.log = self.log.bind(host=host)
        self.discovery = AsyncClient(self, control.discovery, self.incarnation, security)
        self.rendezvous = AsyncClient(self, control.rendezvous, self.incarnation, security)
        self.registry = AsyncClient(self, control.registry, self.incarnation, security)
        self.events = Subscription(self.ctx, control.events, control.notifier, self.incarnation, security)
        self.control_endpoints = control.values()
        self.control_plane = Reachability(timing.lost_after, time.monotonic())
        self.events.start()
        self.watch(self.events.sock, self._on_events)
        self.workers: dict[int, Worker] = {}
        self.event_routes: dict[int, bytes] = {}
        self.job: int | None = None
        self.latest_round: dict[str, Any] | None = None
        self.registered = False
        self._heartbeat_in_flight = False
        self.draining_since: float | None = None
        self._kill_at: float | None = None
        self.warm = False
        self._reported_warm = False
        self.warming: set[int] = set()
        self.joined: set[int] = set()
        self.warm_deadline = 0.0
        self.plan: dict[str, Any] | None = None
        self.policy = RestartPolicy()
        self.crashes = CrashHistory()
        self.down: set[int] = set()
        self.down_version = 0
        self.restart_at: dict[int, float] = {}
        self.standbys: dict[int, Worker] = {}
        self.standbys_waiting: dict[int, Request] = {}
        self.standbys_given_up = False
        self.snapshots = SnapshotKeeper(host, self.log)
        for msg_type in FORWARDED:
            self._handlers[msg_type] = self._forward
        self._install_signals()
        self.every(timing.heartbeat, self._heartbeat)
        self.every(timing.heartbeat, self._ping_workers)
        self.every(0.2, self._check_drain)
        self.every(0.2, self._escalate)
        self.every(0.05, self._restart_due)
        self.every(METRICS_INTERVAL, self._update_metrics)
        self._register()
        self.registry.send("job", on_reply=self._on_job_state, on_timeout=self._become_warm, timeout=1.0, deadline=2.0)

    # -- signals -------------------------------------------------------------------------------
    def _install_signals(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        self._signal_pipe = (read_fd, write_fd)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: None)
        self.watch(read_fd, self._on_signal)

    def serve_forever(self) -> None:
        self.log.info("serving", endpoint=self.endpoint, slots=self.slots)
        try:
            self.run()
        finally:
            self._stop_all_workers(signal.SIGKILL)
            self._stop_standbys(signal.SIGKILL)
            for worker in [*self.workers.values(), *self.standbys.values()]:
                worker.process.wait()
            self._reap()
            self.snapshots.close()
            self.close()
            self.log.info("stopped")

    def _on_signal(self) -> None:
        """Signals are handled here, in the loop, never inside a signal handler: the wakeup fd names them."""
        received = b""
        try:
            while chunk := os.read(self._signal_pipe[0], 512):
                received += chunk
        except BlockingIOError:
            pass
        self._reap()
        for signum in received:
            if signum in (signal.SIGTERM, signal.SIGINT):
                self.begin_drain()

    # -- registration and heartbeats -----------------------------------------------------------
    def _ping_discovery(self, msg_type: str, body: dict[str, Any], on_reply: Any) -> None:
        """One register or heartbeat at a time, sent again (the same request: answered once) every heartbeat
        interval until the host would count as lost: an overloaded discovery answers each once, instead of
        getting a new registration from every agent every second."""
        self._heartbeat_in_flight = True
        self._reported_warm = self.warm
        self.discovery.send(
            msg_type,
            {"host": self.host, "incarnation": self.incarnation, "warm": self.warm, **self.snapshots.report(), **body},
            on_reply=on_reply,
            on_timeout=self._heartbeat_lost,
            timeout=self.timing.heartbeat,
            deadline=self.timing.lost_after,
        )

    def _register(self) -> None:
        self._ping_discovery("register", {"slots": self.slots, "down": sorted(self.down), "down_version": self.down_version}, self._on_registered)

    def _on_registered(self, reply: Message) -> None:
        self._heartbeat_in_flight = False
        self._control_plane_reached()
        if reply.error:
            self.log.warning("register_refused", reason=reply.body.get("message"))
            return
        if not self.registered:
            self.log.info("registered")
        self.registered = True
        self._report_warmth()

    def _heartbeat_lost(self) -> None:
        """No reply within a heartbeat: after a few in a row, a warning naming where the agent tries (then one a
        minute). Resolving the hosts blocks the loop while DNS answers, at most once a minute."""
        self._heartbeat_in_flight = False
        now = time.monotonic()
        if self.control_plane.missed(now):
            unresolved = unresolved_hosts(self.control_endpoints)
            self.log.warning(
                "control_plane_unreachable",
                endpoints=self.control_endpoints,
                silent_s=round(self.control_plane.silent_for(now), 1),
                reason="; ".join(f"{host} does not resolve" for host in unresolved) or "no reply",
                retrying_every_s=self.timing.heartbeat,
            )

    def _control_plane_reached(self) -> None:
        """A reply from discovery: after a warning, one line saying the control plane answers again."""
        silent = self.control_plane.reached(time.monotonic())
        if silent is not None:
            self.log.warning("control_plane_reachable", endpoint=self.discovery.endpoint, silent_s=round(silent, 1))

    def _heartbeat(self) -> None:
        self.snapshots.tick()
        if self.warming and time.monotonic() > self.warm_deadline:
            self.log.warning("warm_up_timeout", waiting_for=sorted(self.warming))
            self.warming.clear()
            self._become_warm()
            return
        if self._heartbeat_in_flight or self.draining_since is not None and not self.workers:
            return
        if not self.registered:
            self._register()
            return
        self._ping_discovery("heartbeat", {}, self._on_heartbeat_reply)

    def _on_heartbeat_reply(self, reply: Message) -> None:
        self._heartbeat_in_flight = False
        self._control_plane_reached()
        status = reply.body.get("status")
        if status == "lost":
            self.log.warning("host_declared_lost", workers=len(self.workers))
            self.latest_round = None
            self.restart_at.clear()
            self.down = set()
            self._stop_all_workers(signal.SIGKILL)
        if status in ("lost", "unknown"):
            self.registered = False
            self._register()
        else:
            self._report_warmth()

    def _report_warmth(self) -> None:
        """Tell discovery at once when the agent became warm after its last register/heartbeat went out."""
        if self.warm and not self._reported_warm and not self._heartbeat_in_flight:
            self._heartbeat()

    # -- events from the control plane ---------------------------------------------------------
    def _on_events(self) -> None:
        for event in self.events.receive():
            handler = getattr(self, f"_event_{event.type}", None)
            if handler is not None:
                handler(event.body)
            if event.type in RELAYED_EVENTS:
                self._relay(event)

    def _event_round(self, body: dict[str, Any]) -> None:
        self.latest_round = body
        self._adopt_job(body)
        self._ensure_workers()

    def _adopt_job(self, plan: dict[str, Any]) -> None:
        """The job to run workers for: its command, environment and restart policy; a new job starts with no crashes."""
        if plan.get("job") != self.job:
            self.crashes.forget()
            self.standbys_given_up = False
            self.snapshots.start_job(plan)
        self.job, self.plan, self.policy = plan.get("job"), plan, RestartPolicy.of_job(plan)
        self._keep_standbys()

    def _ensure_workers(self) -> None:
        """Give each slot of this host in the latest round that has no live process one: a standby, or a new process."""
        if self.draining_since is not None or self.job is None or self.latest_round is None:
            return
        for slot in slots_of(self.latest_round.get("hosts", []), self.host):
            if slot.local_rank not in self.workers:
                self.restart_at.pop(slot.local_rank, None)
                if not self._admit_standby(slot.local_rank):
                    self._spawn(slot.local_rank, self.latest_round, slot)

    def _event_kill_worker(self, body: dict[str, Any]) -> None:
        worker = self.workers.get(body.get("local_rank", -1))
        if body.get("host") == self.host and worker is not None and body.get("pid") in (None, worker.pid):
            self.log.warning("killing_worker", local_rank=worker.local_rank, pid=worker.pid, reason="registry declared it hung")
            worker.stop_requested = True
            worker.signal(signal.SIGKILL)

    def _event_job_finished(self, body: dict[str, Any]) -> None:
        self.job = None
        self.latest_round = None
        self.plan = None
        self.restart_at.clear()
        self._set_down(set())
        self._stop_standbys(signal.SIGTERM)
        self.snapshots.end_job()
        if self.workers:
            self.log.info("job_finished_stopping_workers", workers=len(self.workers), state=body.get("state"))
            self._stop_all_workers(signal.SIGTERM)

    def _relay(self, event: Message) -> None:
        for route in list(self.event_routes.values()):
            self.push(route, Message(type=event.type, body=event.body, sender=self.sender_id))

    def _ping_workers(self) -> None:
        for route in self.event_routes.values():
            self.push(route, Message(type="agent.heartbeat", body={}, sender=self.sender_id))

    # -- workers -------------------------------------------------------------------------------
    def _spawn(self, local_rank: int, job: dict[str, Any], slot: SlotInfo | None) -> None:
        """Start the worker of `local_rank` (STANDBY: a spare that waits in `init()` for a slot); `slot` is its
        assignment in the round, None when it starts ahead of one."""
        env = {
            **os.environ,
            **job.get("env", {}),
            **self.timing.as_env(),
            "ELASTIC_AGENT": self.endpoint,
            "ELASTIC_HOST": self.host,
            "ELASTIC_ADVERTISE_ADDR": self.advertise_address,
            "ELASTIC_GPU_SHARED": "1" if self.share_gpus else "0",
            "ELASTIC_JOB": str(job.get("job")),
            **self.snapshots.worker_env(),
        }
        env.setdefault("PYTHONUNBUFFERED", "1")
        if local_rank == STANDBY:
            env["ELASTIC_STANDBY"] = "1"
            for name in ("ELASTIC_LOCAL_RANK", "LOCAL_RANK"):
                env.pop(name, None)
        else:
            env.update(ELASTIC_LOCAL_RANK=str(local_rank), LOCAL_RANK=str(local_rank))
        if slot is not None:
            env.update(round_environment(slot))
        try:
            worker = spawn(local_rank, list(job["command"]), env, job.get("cwd"))
        except OSError as exc:
            self.log.error("spawn_failed", local_rank=local_rank, reason=str(exc))
            if local_rank != STANDBY:
                self._report_exit(local_rank, -1, 127)
            return
        if local_rank == STANDBY:
            self.standbys[worker.pid] = worker
        else:
            self.workers[local_rank] = worker
        for stream, sink in ((worker.process.stdout, sys.stdout.buffer), (worker.process.stderr, sys.stderr.buffer)):
            assert stream is not None
            pipe = PrefixedPipe(os.dup(stream.fileno()), self._output_prefix(worker), sink)
            worker.output.append(pipe)
            self._follow_output(pipe)
            stream.close()
        if local_rank == STANDBY:
            self.log.info("standby_started", pid=worker.pid)
        else:
            self.log.info("worker_started", local_rank=local_rank, rank=None if slot is None else slot.rank, pid=worker.pid, warming=slot is None)

    def _output_prefix(self, worker: Worker) -> str:
        return f"[{self.host}:{'standby' if worker.local_rank == STANDBY else worker.local_rank}] "

    def _follow_output(self, pipe: PrefixedPipe) -> None:
        def on_readable() -> None:
            if not pipe.pump():
                self.unwatch(pipe.fd)

        self.watch(pipe.fd, on_readable)

    def _reap(self) -> None:
        killed_on_request = False
        for worker, code in reap(self.workers):
            self.event_routes.pop(worker.pid, None)
            self.joined.discard(worker.local_rank)
            self.log.info("worker_exited", local_rank=worker.local_rank, pid=worker.pid, exit_code=code, after_script_end=worker.script_ended, after_job_end=self.plan is None)
            self._warmed(worker.local_rank)
            if worker.died_after_its_script(code):
                self.log.warning("worker_died_after_its_script_ended", local_rank=worker.local_rank, pid=worker.pid, signal=-code)
                self._report_exit(worker.local_rank, worker.pid, code, after_script_end=True)
            elif self._crashed(worker, code):
                self._restart_in_place(worker, code)
            else:
                self._report_exit(worker.local_rank, worker.pid, code)
            killed_on_request |= worker.stop_requested
        for standby, code in reap(self.standbys):
            self.event_routes.pop(standby.pid, None)
            self.standbys_waiting.pop(standby.pid, None)
            if not standby.stop_requested:
                self._replace_standby(code)
        if killed_on_request:
            self._ensure_workers()

    def _report_exit(self, local_rank: int, pid: int, code: int, then: Any = None, **verdict: Any) -> None:
        """Tell the registry a worker exited; `then` runs once the registry has it (or could not be reached). A slot
        given up while down (it crashed again before its replacement was ready) is up again only then: the report
        makes the registry blacklist the host at the round's decision, and the host comes back whole, with this
        slot, when its cooldown ends (a slot left down would keep it out of every round for good)."""
        slot = {"host": self.host, "local_rank": local_rank, "pid": pid}
        newest = self.snapshots.newest()
        verdict["snapshot_commit"] = newest.commit if newest is not None else 0
        self.registry.send("worker_exited", {**slot, "exit_code": code, **verdict}, on_reply=lambda _: then and then(), on_timeout=then,
                           timeout=self.timing.request_timeout, deadline=300.0)
        self.rendezvous.send("forget", slot, timeout=self.timing.request_timeout, deadline=60.0)

    # -- crashes: restart in place ---------------------------------------------------------------
    def _crashed(self, worker: Worker, code: int) -> bool:
        """Did this worker die on its own during the job (not stopped by this agent, not finished)?"""
        return code != 0 and not worker.stop_requested and self.plan is not None and self.draining_since is None

    def _restart_in_place(self, worker: Worker, code: int) -> None:
        """A crash: a waiting standby takes the slot at once; otherwise the slot goes down (discovery first, so the
        job re-forms without it) and a replacement starts after the policy's back-off. Too many crashes: give up."""
        local_rank, pid = worker.local_rank, worker.pid
        delay = self.crashes.record(local_rank, time.monotonic(), self.policy)
        if delay is None:
            reason = give_up_reason(self.crashes.count(local_rank), self.policy)
            self.log.warning("slot_given_up", local_rank=local_rank, pid=pid, exit_code=code, reason=reason)
            self._report_exit(local_rank, pid, code, then=lambda: self._set_down(self.down - {local_rank}), restarting=False, gave_up=reason)
            return
        if self._admit_standby(local_rank):
            self._report_exit(local_rank, pid, code, restarting=True)
            return
        self.log.info("slot_restarting", local_rank=local_rank, pid=pid, exit_code=code, delay_s=delay)
        self.restart_at[local_rank] = time.monotonic() + delay
        self._set_down(self.down | {local_rank}, then=lambda: self._report_exit(local_rank, pid, code, restarting=True))

    def _set_down(self, down: set[int], then: Any = None) -> None:
        """Tell discovery which slots are down; `then` runs once discovery has it (or could not be reached)."""
        if down == self.down:
            if then is not None:
                then()
            return
        self.down, self.down_version = down, self.down_version + 1
        body = {"host": self.host, "incarnation": self.incarnation, "down": sorted(down), "down_version": self.down_version}
        self.discovery.send("slots", body, on_reply=lambda _: then and then(), on_timeout=then, timeout=SLOT_REPORT_DEADLINE / 2, deadline=SLOT_REPORT_DEADLINE)

    def _slot_ready(self, local_rank: int) -> None:
        """The slot's process waits in `init()`: the slot is up again, and joins through the host-update path."""
        if local_rank in self.down:
            self.log.info("slot_ready", local_rank=local_rank)
            self._set_down(self.down - {local_rank})

    def _restart_due(self) -> None:
        now = time.monotonic()
        for local_rank, at in list(self.restart_at.items()):
            if now < at:
                continue
            del self.restart_at[local_rank]
            if local_rank == STANDBY:
                self._keep_standbys()
            elif self.plan is not None and self.draining_since is None and local_rank not in self.workers and not self._admit_standby(local_rank):
                self._spawn(local_rank, self.plan, None)

    # -- standbys: spare processes waiting in init() -----------------------------------------------
    def _keep_standbys(self) -> None:
        """Start standbys until `--standby` of them exist (while a job runs and the host is not draining)."""
        if self.plan is None or self.draining_since is not None or self.standbys_given_up or STANDBY in self.restart_at:
            return
        for _ in range(self.standby - len(self.standbys)):
            self._spawn(STANDBY, self.plan, None)

    def _replace_standby(self, code: int) -> None:
        """A standby died while waiting: replaced silently (with the slots' back-off, so a script that dies at
        start-up does not spin); one that keeps dying is given up for this job."""
        if self.plan is None or self.draining_since is not None:
            return
        delay = self.crashes.record(STANDBY, time.monotonic(), self.policy)
        if delay is None:
            self.standbys_given_up = True
            self.log.warning("standbys_given_up", exit_code=code, crashes=self.crashes.count(STANDBY), window_s=self.policy.window)
            return
        self.log.info("standby_replaced", exit_code=code, delay_s=delay)
        self.restart_at[STANDBY] = time.monotonic() + delay

    def _admit_standby(self, local_rank: int) -> bool:
        """Hand the slot `local_rank` (which has no process) to the longest-waiting standby, if one waits."""
        if not self.standbys_waiting or local_rank in self.workers:
            return False
        pid, request = next(iter(self.standbys_waiting.items()))
        del self.standbys_waiting[pid]
        worker = self.standbys.pop(pid)
        worker.local_rank = local_rank
        for pipe in worker.output:
            pipe.prefix = self._output_prefix(worker).encode()
        self.workers[local_rank] = worker
        self.restart_at.pop(local_rank, None)
        request.reply({"local_rank": local_rank})
        self.log.info("standby_admitted", local_rank=local_rank, pid=pid)
        self._slot_ready(local_rank)
        self._keep_standbys()
        return True

    def _stop_standbys(self, sig: int) -> None:
        self.standbys_waiting.clear()
        for standby in self.standbys.values():
            standby.stop_requested = True
            standby.signal(sig)

    @handles("standby")
    def on_standby(self, request: Request) -> Any:
        """A standby waits here, in `init()`, until a slot needs it; the reply is its local rank."""
        pid = field(request.body, "pid", int)
        if pid not in self.standbys:
            raise RequestError("not_a_standby", f"process {pid} is not a standby of host {self.host}")
        self.standbys_waiting[pid] = request
        self.log.info("standby_waiting", pid=pid)
        for local_rank in sorted(k for k in self.restart_at if k != STANDBY):
            if self._admit_standby(local_rank):
                break
        return DEFERRED

    def _stop_all_workers(self, sig: int) -> None:
        """Signal every worker; after SIGTERM, `_escalate` sends SIGKILL to those still alive after the grace."""
        for worker in self.workers.values():
            worker.stop_requested = True
            worker.signal(sig)
        if sig != signal.SIGKILL and self.workers:
            self._kill_at = time.monotonic() + STOP_GRACE

    def _escalate(self) -> None:
        if self._kill_at is not None and time.monotonic() >= self._kill_at:
            self._kill_at = None
            for worker in self.workers.values():
                worker.signal(signal.SIGKILL)

    # -- draining ------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        if self.draining_since is not None:
            self.log.info("stop_now", workers=len(self.workers))
            self._stop_all_workers(signal.SIGKILL)
            self._leave()
            return
        self.draining_since = time.monotonic()
        self.log.info("draining", workers=len(self.workers))
        self.restart_at.clear()
        self._stop_standbys(signal.SIGTERM)
        for local_rank, worker in self.workers.items():
            if local_rank not in self.joined:
                worker.stop_requested = True
                worker.signal(signal.SIGTERM)
        if self.workers:
            self.discovery.send("drain", {"host": self.host}, timeout=self.timing.request_timeout, deadline=self.drain_timeout)
        else:
            self._leave()

    def _check_drain(self) -> None:
        if self.draining_since is None:
            return
        if self.workers and time.monotonic() - self.draining_since < self.drain_timeout:
            return
        if self.workers:
            if self._kill_at is None:
                self.log.warning("drain_timeout", workers=len(self.workers))
                self._stop_all_workers(signal.SIGTERM)
            return
        self._leave()

    def _leave(self) -> None:
        if self.registered:
            self.discovery.send("unregister", {"host": self.host, "incarnation": self.incarnation}, on_reply=lambda _: self.stop(), on_timeout=self.stop, timeout=1.0, deadline=2.0)
            self.registered = False
        elif not self.discovery.in_flight:
            self.stop()

    # -- warming up: a host that joins a running job starts its workers before it counts ------
    def _on_job_state(self, reply: Message) -> None:
        """A job is running: start this host's workers now, and become available once they all wait for a round,
        so the running workers are interrupted only when the newcomers are ready (no stall for process start)."""
        job = reply.body
        if reply.error or job.get("state") not in ("waiting", "running") or not job.get("spec") or self.draining_since is not None:
            self._become_warm()
            return
        plan = {**job["spec"], "job": job["job"], "round": job["round"], "job_key": job.get("job_key")}
        self._adopt_job(plan)
        self.warming = set(range(self.slots))
        self.warm_deadline = time.monotonic() + WARM_UP_LIMIT
        self.log.info("warming_up", job=job["job"], slots=self.slots)
        for local_rank in range(self.slots):
            self._spawn(local_rank, plan, None)

    def _warmed(self, local_rank: int) -> None:
        if local_rank in self.warming:
            self.warming.discard(local_rank)
            if not self.warming:
                self._become_warm()

    def _become_warm(self) -> None:
        if self.warm:
            return
        self.warm = True
        self.log.info("warm")
        if self.registered:
            self._report_warmth()

    # -- worker requests -----------------------------------------------------------------------
    @handles("subscribe")
    def on_subscribe(self, request: Request) -> dict[str, Any]:
        pid = field(request.body, "pid", int)
        self.event_routes[pid] = request.route
        return {"host": self.host, "heartbeat": self.timing.heartbeat}

    @handles("script_ended")
    def on_script_ended(self, request: Request) -> dict[str, Any]:
        """A worker's script has ended (libworker tells us at exit, before the interpreter tears down)."""
        pid = field(request.body, "pid", int)
        for worker in self.workers.values():
            if worker.pid == pid:
                worker.script_ended, worker.uncaught_exception = True, request.body.get("uncaught_exception") is True
        return {}

    @handles("committed")
    def on_committed(self, request: Request) -> dict[str, Any]:
        """The host's snapshot writer saved a commit in `seconds` (one-way: the worker never reads this reply)."""
        seconds = field(request.body, "seconds", float)
        if seconds < 0:
            raise RequestError("bad_request", "seconds must be at least 0")
        COMMIT_SECONDS.labels(self.host).observe(seconds)
        return {}

    def _forward(self, request: Request) -> Any:
        body = {**request.body, "host": self.host}
        if request.msg.type == "rank_and_size" and isinstance(body.get("local_rank"), int):
            self._warmed(body["local_rank"])
            self._slot_ready(body["local_rank"])
        parked = request.msg.type in PARKED
        def relay(reply: Message) -> None:
            if request.msg.type == "rank_and_size" and "rank" in reply.body:
                self.joined.add(body["local_rank"])
            request.reply(reply.body, reply.raw)

        self.rendezvous.send(
            request.msg.type,
            body,
            round=request.msg.round,
            raw=request.msg.raw,
            on_reply=relay,
            timeout=5.0 if parked else self.timing.request_timeout,
            deadline=None if parked else 30.0,
        )
        return DEFERRED

    # -- metrics -------------------------------------------------------------------------------
    def _update_metrics(self) -> None:
        """Count workers by state here, in the loop: the thread serving metrics must not iterate the agent's dicts."""
        states = ["stopping" if w.stop_requested else "running" if rank in self.joined else "starting" for rank, w in self.workers.items()]
        states += ["standby"] * len(self.standbys) + ["restarting"] * sum(rank != STANDBY for rank in self.restart_at)
        for state in WORKER_STATES:
            WORKERS_BY_STATE.labels(self.host, state).set(states.count(state))

    def close(self) -> None:
        self.events.close()
        signal.set_wakeup_fd(-1)
        for fd in self._signal_pipe:
            os.close(fd)
        super().close()
