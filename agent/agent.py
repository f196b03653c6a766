"""AgentService: the control plane's hands on one host, a supervisor that reads like a loop (gunicorn's arbiter).

The agent is built from its host's `AgentConfig` (agent/host_options.py) and the control plane's endpoints and
timing. The parts, each with one job:
- agent/discovery_link.py: registration and heartbeats with discovery, slot and drain
  reports, whether the control plane answers, the host's health checks (agent/host_health.py);
- agent/keeper.py: the worker processes (start, reap, restart in place, standbys, warm-up, stop), carrying out the
  decisions of the host's slot book (agent/slots.py: crashes and back-off, down slots, warm-up, drain), which it
  alone changes; agent/launcher.py starts each process, forked from the host's zygote (agent/fork_server.py) or
  spawned (agent/workers.py); agent/reports.py tells the control plane of each exit;
- agent/snapshots.py: the host's snapshot of the job's committed state, which
  the launcher owns from a job's start to its end (and flushes every heartbeat);
- agent/metrics.py: workers by state, and the seconds each commit took;
- agent/wait_watch.py: the workers' waits in collectives and their progress,
  reported to the registry, which finds hung workers and stragglers by them;
  agent/hung_workers.py: a worker declared hung gives its stack, then dies.

The loop's steps, each a small named method, in a fixed order (an event or
request is carried out at once by a named method of the keeper's: a round's
workers start without waiting for a tick):
- signals wake the loop through the wakeup fd, never run in a handler
  (`handle_signals`: SIGCHLD reaps; SIGTERM drains the host: workers leave at
  their next commit, then the agent unregisters and exits; a second SIGTERM
  stops them now);
- every tick (`tick`, agent/intervals.py): restarts due after their back-off, starts held back
  for the fork server, SIGKILL after the stop grace, the drain's end, the
  metrics, the workers' waits (reported at once when one crosses a limit),
  the hung workers' stack dumps, the slots that asked for a round since the host's entry;
- every heartbeat interval (`heartbeat`): the warm-up limit, discovery's
  heartbeat, the workers' ping, their waits.

The notifier's events, by the table in `__init__`: `round` gives each of
this host's slots in the round a process, `kill_worker` (agent/hung_workers.py)
and `job_finished` stop workers; `hosts_updated` and `abort` are relayed to the workers.
The workers' owner-only ipc socket: their requests for a place in the round go to
the rendezvous as the host's one entry, their lookups of a round's key as one
lookup (agent/round_entry.py), rank 0's `kv_set` with this host's name; each worker's event channel
(`subscribe`, a process of its own only) receives the relayed events, a standby waits in `standby` for a
slot, `script_ended` (sent by libworker at exit) marks a worker whose script
ended, the snapshot writer reports each commit's duration (`committed`), and
a torchrun-mode slot's supervisor reports each round's command
(`command_started`) and its failure (`child_failed`, slot_processes/torchrun_slot.py).
Warm-up: joining a running job, the agent starts its workers first and
reports itself warm (available) only when they all wait for a round.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from elastic_control_plane.agent.discovery_link import DiscoveryLink
from elastic_control_plane.agent.fork_choice import own_key
from elastic_control_plane.agent.fork_server import ForkServer
from elastic_control_plane.agent.host_health import HostHealth
from elastic_control_plane.agent.host_options import AgentConfig
from elastic_control_plane.agent.hung_workers import HungWorkers
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.keeper import KeeperConfig, WorkerKeeper
from elastic_control_plane.agent.launcher import Launcher
from elastic_control_plane.agent.metrics import WorkerStates
from elastic_control_plane.agent.reports import ExitReports
from elastic_control_plane.agent.round_entry import HostEntry, RoundKeyLookups
from elastic_control_plane.agent.signal_wakeup import SignalWakeup
from elastic_control_plane.agent.wait_watch import WaitWatch
from elastic_control_plane.agent.workers import HostSettings, Worker
from elastic_control_plane.bus.client import AsyncClient, incarnation_id
from elastic_control_plane.bus.config import Endpoints, Timing
from elastic_control_plane.bus.contract import PUBLISH_KEY, Event
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.pubsub import Subscription
from elastic_control_plane.bus.service import DEFERRED, Request, RequestError, Service, field, handles
from elastic_control_plane.bus.sockets import Security
from elastic_control_plane.job.plan import JobPlan

RELAYED_EVENTS = (Event.HOSTS_UPDATED, Event.ABORT)


def agent_endpoint(run_dir: Path, host: str) -> str:
    return f"ipc://{run_dir}/agent-{host}.sock"


class AgentService(Service):
    name = "agent"

    def __init__(
        self, config: AgentConfig, control: Endpoints, timing: Timing, security: Security = Security(), **kw: Any
    ) -> None:
        super().__init__(agent_endpoint(config.run_dir, config.host), security=security, **kw)
        host, slots = config.host, config.slots
        self.config, self.host, self.slots, self.timing = config, host, slots, timing
        settings = HostSettings(host, self.endpoint, config.advertise_address, config.share_gpus, timing.as_env())
        self.incarnation = incarnation_id("agent", host)
        self.sender_id = self.incarnation
        self.log = self.log.bind(host=host)
        self.health, discovery = (
            HostHealth(config.health, self.log),
            AsyncClient(self, control.discovery, self.incarnation, security),
        )
        self.link = DiscoveryLink(
            discovery, host, slots, self.incarnation, timing, control.values(), self, self.log, self.health
        )
        self.watch(self.health.fileno(), self.link.health_checked)
        self.rendezvous = AsyncClient(self, control.rendezvous, self.incarnation, security)
        self.registry = AsyncClient(self, control.registry, self.incarnation, security)
        server = ForkServer(config.fork_server, self.log)
        self.wait_watch = WaitWatch(host, self.registry, timing.heartbeat, self.log)
        self.launcher = Launcher(settings, server, self.wait_watch, self, timing.heartbeat, self.log)
        self.wait_watch.progress = self.launcher.snapshots.progress  # sent with each report: the goodput ledger's
        reports = ExitReports(host, timing, self.registry, self.rendezvous, self.launcher.snapshots, self.log)
        self.keeper = WorkerKeeper(
            KeeperConfig(settings, slots, config.standby),
            launcher=self.launcher,
            link=self.link,
            reports=reports,
            on_exited=self._worker_exited,
            on_warm=self._become_warm,
            log=self.log,
        )
        self.hung_workers = HungWorkers(host, self.keeper.workers, self.log)
        self.host_entry = HostEntry(host, slots, self.rendezvous, self.keeper.workers.keys, self.keeper.slot_entered)
        self.round_keys = RoundKeyLookups(host, self.rendezvous)
        self.events = Subscription(self.ctx, control.events, control.notifier, self.incarnation, security)
        self.events.start()
        self.watch(self.events.sock, self._on_events)
        self.event_handlers = {
            Event.ROUND: self._on_round,
            Event.KILL_WORKER: self.hung_workers.kill,
            Event.WORKER_SUSPECTED: self.hung_workers.suspect,
            Event.JOB_FINISHED: self._on_job_finished,
        }
        self.signals = SignalWakeup((signal.SIGCHLD, signal.SIGTERM, signal.SIGINT))
        self.watch(self.signals.read_fd, self.handle_signals)
        # After the handlers: the zygote starts with the dispositions a spawned worker gets (a signal the agent
        # catches is default in its children), not with what the agent inherited (SIGINT ignored under `cmd &`).
        server.prepare(own_key())
        self.worker_states = WorkerStates(host, self.keeper)
        self.every(timing.heartbeat, self.heartbeat)
        self.every(INTERVALS.tick, self.tick)
        self.link.register()
        self.registry.send("job", on_reply=self._on_job_state, on_timeout=self._become_warm, timeout=1.0, deadline=2.0)

    def serve_forever(self) -> None:
        self.log.info("serving", endpoint=self.endpoint, slots=self.slots)
        try:
            self.run()
        finally:
            self.keeper.stop_everything()
            self.close()
            self.log.info("stopped")

    def handle_signals(self) -> None:
        """The signals that woke the loop, handled here, never inside a signal handler: SIGCHLD reaps, SIGTERM and
        SIGINT drain (a second one stops the workers now)."""
        received = self.signals.received()
        self.keeper.reap_workers(self.health.children())
        for signum in received:
            if signum in (signal.SIGTERM, signal.SIGINT):
                self.begin_drain()

    # -- the loop: its steps, in their order ----------------------------------------------------
    def tick(self) -> None:
        """Every tick (agent/intervals.py): restarts due after their back-off, starts held back for the fork server,
        SIGKILL after the stop grace, the drain's end, the metrics, the workers' waits, the hung workers' stack dumps,
        the slots that asked for a round since the host's entry."""
        self.keeper.restart_due_slots()
        self.keeper.start_held_back()
        self.keeper.escalate_stops()
        self.check_drain()
        self.worker_states.update()
        self.wait_watch.tick(self.keeper.workers.values())
        self.hung_workers.tick()
        self.host_entry.tick()

    def heartbeat(self) -> None:
        """Every heartbeat interval, as discovery and the workers expect it: the warm-up limit, discovery's heartbeat,
        the workers' ping, and their waits to the registry."""
        self.beat_discovery()
        self.ping_workers()
        self.wait_watch.report(self.keeper.workers.values())

    def beat_discovery(self) -> None:
        late = self.keeper.warm_up_expired()
        if late:
            self.log.warning("warm_up_timeout", waiting_for=sorted(late))
            self._become_warm()
        elif not (self.keeper.draining and not self.keeper.workers):
            self.link.beat()

    def ping_workers(self) -> None:
        self._tell_workers(Message(type="agent.heartbeat", body={}, sender=self.sender_id))

    def _tell_workers(self, message: Message) -> None:
        """Push `message` to every worker and standby that subscribed."""
        for worker in self.keeper.processes():
            if worker.event_route is not None:
                self.push(worker.event_route, message)

    # -- what the discovery link reads of the host and tells it (agent/discovery_link.py's HostSide) --------
    def host_report(self) -> dict[str, Any]:
        """What each heartbeat tells discovery of the host beside its liveness: its snapshot, last checkpoint and
        fork server (what `elasticctl status` shows)."""
        return {**self.launcher.snapshots.report(), "fork_server": self.launcher.availability()}

    def slots_down(self) -> dict[str, Any]:
        return self.keeper.slots_down()

    def host_lost(self) -> None:
        self.keeper.host_lost()

    def _worker_exited(self, worker: Worker) -> None:
        """A reaped worker's record went with it (agent/workers.py); only the host's entry may still carry it."""
        self.host_entry.drop(worker.local_rank, worker.pid)

    # -- events from the control plane ---------------------------------------------------------
    def _on_events(self) -> None:
        for event in self.events.receive():
            self.log.info("notified", event_type=event.type, seq=event.body.get("seq"), key=event.body.get(PUBLISH_KEY))
            handler = self.event_handlers.get(event.type)
            if handler is not None:
                handler(event.body)
            if event.type in RELAYED_EVENTS:
                self._tell_workers(Message(type=event.type, body=event.body, sender=self.sender_id))

    def _on_round(self, body: dict[str, Any]) -> None:
        try:
            plan = JobPlan.from_wire(body)
        except ValueError as exc:
            self.log.warning("bad_round", reason=str(exc))
            return
        self.round_keys.job_round(plan.job_key)
        self.keeper.take_round(plan, body)

    def _on_job_finished(self, body: dict[str, Any]) -> None:
        self.round_keys.job_ended()
        if self.keeper.workers:
            self.log.info("job_finished_stopping_workers", workers=len(self.keeper.workers), state=body.get("state"))
        self.keeper.end_job()

    # -- draining ------------------------------------------------------------------------------
    def begin_drain(self) -> None:
        if not self.keeper.begin_drain():
            self.log.info("stop_now", workers=len(self.keeper.workers))
            self.keeper.stop_all(signal.SIGKILL)
            self.link.unregister(self.stop)
            return
        self.log.info("draining", workers=len(self.keeper.workers))
        if self.keeper.workers:
            self.link.drain(self.config.drain_timeout)
        self.check_drain()  # no workers: gone at once

    def check_drain(self) -> None:
        """Draining: once the workers have left, checkpoint, unregister, exit; past the drain timeout, stop the rest."""
        workers = self.keeper.workers
        if not self.keeper.draining or workers and not self.keeper.drain_overdue(self.config.drain_timeout):
            return
        if not workers:
            self.launcher.snapshots.flush_now()
            self.link.unregister(self.stop)
        elif not self.keeper.stopping:
            self.log.warning("drain_timeout", workers=len(workers))
            self.keeper.stop_all(signal.SIGTERM)

    # -- warming up: a host that joins a running job starts its workers before it counts ------
    def _on_job_state(self, reply: Message) -> None:
        """A job is running: start this host's workers now, and become available once they all wait for a round,
        so the running workers are interrupted only when the newcomers are ready (no stall for process start)."""
        job = reply.body
        if reply.error or job.get("state") not in ("waiting", "running") or not job.get("spec") or self.keeper.draining:
            self._become_warm()
            return
        try:
            plan = JobPlan.from_wire(job)
        except ValueError:
            self._become_warm()
            return
        self.keeper.warm_up(plan)

    def readiness(self) -> str | None:
        """None when this host may be given work: registered with discovery, its last health check passed, its workers'
        interpreter warm; else why not (read by the metrics thread for /readyz: plain attributes only)."""
        if not self.link.registered:
            return "not registered with discovery"
        return self.health.unready() or (None if self.link.warm else "the workers' interpreter is not warm yet")

    def _become_warm(self) -> None:
        if self.link.warm:
            return
        self.log.info("warm")
        self.link.become_warm()

    # -- worker requests -----------------------------------------------------------------------
    @handles("subscribe")
    def on_subscribe(self, request: Request) -> dict[str, Any]:
        pid = field(request.body, "pid", int)
        worker = self.keeper.find(pid)
        if worker is None:
            raise RequestError("not_a_worker", f"process {pid} is not a worker or standby of host {self.host}")
        worker.event_route = request.route
        return {"host": self.host, "heartbeat": self.timing.heartbeat}

    @handles("standby")
    def on_standby(self, request: Request) -> Any:
        """A standby waits here, in `init()`, until a slot needs it; the reply is its local rank."""
        pid = field(request.body, "pid", int)
        if not self.keeper.park_standby(pid, request):
            raise RequestError("not_a_standby", f"process {pid} is not a standby of host {self.host}")
        return DEFERRED

    @handles("child_failed")
    def on_child_failed(self, request: Request) -> dict[str, Any]:
        """A torchrun-mode slot's command failed in its round (slot_processes/torchrun_slot.py): reported as a worker
        restarted in place, so the registry aborts the round for every slot; the slot's supervisor lives on and enters
        the next."""
        local_rank, pid, code = (
            field(request.body, "local_rank", int),
            field(request.body, "pid", int),
            field(request.body, "exit_code", int),
        )
        if not self.keeper.command_failed(local_rank, pid, code):
            raise RequestError(
                "not_a_worker", f"process {pid} is not the worker of slot {local_rank} on host {self.host}"
            )
        return {}

    @handles("command_started")
    def on_command_started(self, request: Request) -> dict[str, Any]:
        """A torchrun-mode slot's supervisor started its round's command (forked from its seed, or spawned)."""
        local_rank, pid, command_pid = (
            field(request.body, "local_rank", int),
            field(request.body, "pid", int),
            field(request.body, "command_pid", int),
        )
        forked = request.body.get("forked")
        if not isinstance(forked, bool):
            raise RequestError("bad_request", "field 'forked' must be a bool")
        self.log.info(
            "command_started",
            local_rank=local_rank,
            pid=pid,
            command_pid=command_pid,
            forked=forked,
            round=request.body.get("round"),
        )
        return {}

    @handles("script_ended")
    def on_script_ended(self, request: Request) -> dict[str, Any]:
        """A worker's script has ended (libworker tells us at exit, before the interpreter tears down)."""
        pid = field(request.body, "pid", int)
        self.keeper.script_ended(pid, request.body.get("uncaught_exception") is True)
        return {}

    @handles("committed")
    def on_committed(self, request: Request) -> dict[str, Any]:
        """The host's snapshot writer saved a commit in `seconds` (one-way: the worker never reads this reply)."""
        seconds = field(request.body, "seconds", float)
        if seconds < 0:
            raise RequestError("bad_request", "seconds must be at least 0")
        self.launcher.snapshots.committed(seconds)
        return {}

    @handles("resumed")
    def on_resumed(self, request: Request) -> dict[str, Any]:  # the host's snapshot writer synced a round (one-way)
        self.launcher.snapshots.resumed_in(field(request.body, "round", int))
        return {}

    @handles("rank_and_size")
    def on_rank_and_size(self, request: Request) -> Any:
        """A worker asks for its place in the round: its slot is warm and up, and entered once it has a rank (the
        host's one entry carries it: agent/round_entry.py)."""
        self.host_entry.ask(request)
        self.keeper.slot_asks_rank(request.body["local_rank"])
        return DEFERRED

    @handles("kv_set")
    def on_kv_set(self, request: Request) -> Any:
        """Rank 0 publishes a round's key (its store's address); sent on with this host's name, the reply goes back."""
        self.rendezvous.send(
            "kv_set",
            {**request.body, "host": self.host},
            round=request.msg.round,
            raw=request.msg.raw,
            on_reply=lambda reply: request.reply(reply.body, reply.raw),
            timeout=self.timing.request_timeout,
            deadline=30.0,
        )
        return DEFERRED

    @handles("kv_get")
    def on_kv_get(self, request: Request) -> Any:
        self.round_keys.get(request)
        return DEFERRED

    def close(self) -> None:
        self.health.close()
        self.events.close()
        self.signals.close()
        super().close()
