"""DiscoveryService: tracks live agents (registration + heartbeats), an optional discovery script, drain and blacklist.

With `pods` (services/discovery/kubernetes.py's Ready pods, or slurm.py's nodes of a Slurm job) standing where a
script's hosts would, no host is usable before their first list, a change wakes the loop at once, and a job that
names a script too is refused (`configure` and `restore` answer bad_request).

Messages:
- register {host, slots, incarnation, warm, down, down_version, snapshot, checkpoint, fork_server, pod_token}: an
  agent (re)starts; warm=False while its workers start. With `pod_identity`, a host's pod proves its name first
  (pod_token; services/discovery/pod_identity.py).
- heartbeat {host, incarnation, warm, snapshot, checkpoint, fork_server} -> {status: ok | unknown | lost}. snapshot
  {commit, bytes, written_at}: the host's snapshot; checkpoint {commit, bytes, written_at, path}: its last durable
  copy; fork_server {state: ready | starting | unavailable | off, reason}.
- slots {host, incarnation, down, down_version} -> {status}: the agent's slots whose worker crashed and is not back.
- unregister {host, incarnation}: an agent leaves cleanly.
- hosts -> {incarnation, settling, version, timestamp, published, available: [[name, [slot ids]]], all: [...], lost:
  [names], lost_declared, excluded}. published: the host list the last hosts_updated (`version`) announced;
  lost_declared: the lost hosts their source said were gone (a Slurm node DOWN: `pods.take_lost()`), not silent;
  excluded: [{host, requeue, reason}], the hosts a requeued Slurm job runs without (slurm.py).
- hosts {brief: true, unless} -> the same without published and all, with agents {name: incarnation} (live hosts),
  marked (the rows of all for hosts drained or blacklisted) and generation [incarnation, number]: the registry's, every
  tick. unless: the generation the asker holds; when the list is still that one, only {unchanged: true, generation}.
- snapshots -> {incarnation, commits: {host: commit}, usable}: each live host's snapshot, and whether any host is
  neither lost nor blacklisted (the registry, judging a round).
- drain {host} / undrain {host}: the operator. blacklist {host, reason}: the registry, after a failure on the host.
- health reports, rechecks, `uncordon {host}`: readmission.py; the probe of hosts entering the job: collective_probe.py.
- configure {discovery_script, max_np, cooldown, probation_clean} -> {incarnation}: the registry, at a job's submission.
- restore {discovery_script, max_np, cooldown, probation_clean, marks, expected}: the registry, to a discovery that
  restarted during a job. marks {host: {draining, blacklisted, until (wall-clock seconds, or null: for good), count,
  reason}}; expected [[host, [slot ids]]]: the hosts of the job's current round.

Each request's body is checked field by field before anything changes (services/discovery/bodies.py).

A host is lost after `heartbeat x missed_heartbeats` of silence. If discovery itself was stalled (stopped, starved)
for half that long, nobody's silence counts: every live host gets a fresh start instead of being declared lost.

A discovery that starts is *settling* (`hosts` says so) until the agents have registered again: for `lost_after`
(at least SETTLE_MIN seconds), or less once the registry restored it and every host of the job's round is back.
Meanwhile it publishes nothing: the agents' registrations rebuild the host set the job runs on and are no news to its
workers. Once settled, the round's missing hosts are lost; the host set is compared with the round's (or taken as is).

When the slots an assignment would use change, `hosts_updated {timestamp, version, added, removed, set, remove}` goes
out through the notifier; a change beyond max_np sends nothing. `added`/`removed` are Horovod's flags; `set` ([[name,
[slot ids]]]: a host already listed keeps its place, a new one goes last) and `remove` ([names]) turn the list of
`version - 1` into that of `version` (hostset.apply_diff); when they cannot (a host left and came back between two), the
event carries the whole list as `hosts` instead. A subscriber that missed a change asks `hosts` for the whole list
(`published`, at `version`). Changes are coalesced: they are published at most every COALESCE_WINDOW, and at once before
a `hosts` reply, so thousands of registrations make a handful of events and a reader sees what was announced.

Replicated (`--store etcd://...`), the drains and blacklists are kept in etcd as well (services/discovery/marks_log.py),
written before a change is acknowledged; a replica that takes over starts from them and keeps them over the registry's
`restore`. Metrics: services/discovery/metrics.py.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from elastic_control_plane.bus.client import incarnation_id
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.bus.outbox import Outbox
from elastic_control_plane.bus.roles import AGENT, OPERATOR, SERVICE
from elastic_control_plane.bus.service import Request, RequestError, Service, field, handles
from elastic_control_plane.job.assignments import MAX_SLOTS_PER_HOST
from elastic_control_plane.services.discovery import bodies, metrics, probation
from elastic_control_plane.services.discovery.brief import BriefGenerations
from elastic_control_plane.services.discovery.collective_probe import DEFAULT_SLOW_FACTOR, CollectiveProbes
from elastic_control_plane.services.discovery.hostset import LOST, HostSet, effective
from elastic_control_plane.services.discovery.kubernetes import PodSource, pods_and_script
from elastic_control_plane.services.discovery.marks_log import MarksLog, marks_saved
from elastic_control_plane.services.discovery.pod_identity import PodIdentity
from elastic_control_plane.services.discovery.publishing import COALESCE_WINDOW, HostsPublishing
from elastic_control_plane.services.discovery.readmission import Readmission
from elastic_control_plane.services.discovery.script import DiscoveryScript
from elastic_control_plane.services.discovery.slurm import SlurmSource

SETTLE_MIN = 3.0  # seconds a restarted discovery waits for agents at least: a registry restarted with it is up by then


class DiscoveryService(Readmission, CollectiveProbes, HostsPublishing, Service):
    name = "discovery"

    def __init__(
        self,
        endpoint: str,
        notifier_endpoint: str,
        timing: Timing,
        marks_log: MarksLog | None = None,
        pods: PodSource | SlurmSource | None = None,
        pod_identity: PodIdentity | None = None,
        probe_slow_factor: float = DEFAULT_SLOW_FACTOR,
        **kw: Any,
    ) -> None:
        super().__init__(endpoint, **kw)
        self.timing, self.pods, self.pod_identity = timing, pods, pod_identity
        self.start_probes(probe_slow_factor)
        self.hostset, self.probation, self.marks_log = HostSet(), probation.Probation(), marks_log
        if marks_log is not None:
            self.hostset.restore(bodies.marks(marks_log.load(), self.clock(), time.time()))
        self.incarnation = uuid.uuid4().hex
        self.settle_until: float | None = self.clock() + max(SETTLE_MIN, timing.lost_after)
        self.expected: list[tuple[str, tuple[int, ...]]] | None = None
        self.outbox = Outbox(self, notifier_endpoint, incarnation_id(self.name), self.security)
        self.max_np: int | None = None
        self.script = DiscoveryScript(self.log, wait_timeout=timing.discovery_poll * 10)
        self.published: list[tuple[str, tuple[int, ...]]] = []
        self.version, self.timestamp = 0, time.time()
        self.brief = BriefGenerations(self.incarnation)
        self._change_pending, self._last_expire_check = False, self.clock()
        self.every(max(0.02, timing.heartbeat / 4), self._expire)
        self.every(timing.discovery_poll, self._poll_script)
        self.every(metrics.METRICS_INTERVAL, self._update_metrics)
        self.every(COALESCE_WINDOW, self._publish_change)
        if pods is not None:
            self.hostset.script_hosts = {}
            self.watch(pods.fileno(), self._poll_script)
            pods.start()
        if pod_identity is not None:
            self.watch(pod_identity.fileno(), pod_identity.finish)

    # -- agents --------------------------------------------------------------------------------
    @handles("register", roles=(AGENT,))
    def on_register(self, request: Request) -> dict[str, Any]:
        host, slots = field(request.body, "host", str), field(request.body, "slots", int)
        if not 1 <= slots <= MAX_SLOTS_PER_HOST:
            raise RequestError("bad_request", f"slots must be 1 to {MAX_SLOTS_PER_HOST} (got {slots})")
        down, version = bodies.down_slots(request.body) if "down" in request.body else ((), 0)
        incarnation, health = field(request.body, "incarnation", str), bodies.health(request.body)
        if self.pod_identity is not None and not self.pod_identity.proven(host, incarnation):
            return self.pod_identity.review(request, host, incarnation, self.on_register)
        self.hostset.register(host, slots, incarnation, self.clock(), bodies.warm(request.body), down, version)
        self.hostset.hosts[host].snapshots = bodies.snapshots(request.body)
        self.hostset.hosts[host].fork_server = bodies.fork_server(request.body)
        self.log.info("host_registered", host=host, slots=slots, down=list(down))
        self._changed()
        return {"heartbeat": self.timing.heartbeat, **self._take_health(host, health)}

    @handles("slots", roles=(AGENT,))
    def on_slots(self, request: Request) -> dict[str, Any]:
        host = field(request.body, "host", str)
        down, version = bodies.down_slots(request.body)
        status = self.hostset.set_down(host, field(request.body, "incarnation", str), down, version)
        if status == "ok":
            self.log.info("slots_down" if down else "slots_up", host=host, down=list(down))
            self._changed()
        return {"status": status}

    @handles("heartbeat", roles=(AGENT,), replayable=True)
    def on_heartbeat(self, request: Request) -> dict[str, Any]:
        """The hot path (4,096 hosts: 4,096 a second): a lookup, a move to the end of the silence order, and reports
        checked and copied only when they differ from the host's last ones; nothing scans the host set or logs."""
        body = request.body
        host, incarnation, warm = field(body, "host", str), field(body, "incarnation", str), bodies.warm(body)
        record = self.hostset.hosts.get(host)
        reports_changed = record is None or not bodies.same_reports(body, record.snapshots, record.fork_server)
        if reports_changed:
            snapshots, fork_server = bodies.snapshots(body), bodies.fork_server(body)
        was_warm, health = record is not None and record.warm, self._checked_health(body, record)
        status = self.hostset.heartbeat(host, incarnation, self.clock(), warm=warm)
        metrics.HEARTBEATS_BY_STATUS[status].inc()
        if status != "ok":
            return {"status": status}
        if reports_changed:
            self.hostset.hosts[host].snapshots, self.hostset.hosts[host].fork_server = snapshots, fork_server
        if warm and not was_warm:
            self.log.info("host_warm", host=host)
            self._changed()
        return {"status": status, **self._take_health(host, health)}

    @handles("unregister", roles=(AGENT,))
    def on_unregister(self, request: Request) -> dict[str, Any]:
        host = field(request.body, "host", str)
        gone = self.hostset.unregister(host, field(request.body, "incarnation", str))
        if gone:
            self.log.info("host_unregistered", host=host)
            self._changed()
        return {"unregistered": gone}

    def _expire(self) -> None:
        now = self.clock()
        stalled_for = now - self._last_expire_check
        self._last_expire_check = now
        if stalled_for > self.timing.lost_after / 2:
            self.log.warning("discovery_stalled", seconds=round(stalled_for, 3))
            self.hostset.forgive_silence(now)
            return
        lost = self.hostset.expire(now, self.timing.lost_after)
        lifted = self.hostset.lift_cooldowns(now)
        self._readmit(now, lifted)
        for host in self.hostset.lost.forget_due(self.hostset.hosts, now):
            self.log.info("lost_host_forgotten", host=host)
        for host in lost:
            self.log.warning("host_lost", host=host, missed_for=self.timing.lost_after)
        for host in lifted:
            self.log.info("blacklist_lifted", host=host)
        if lost or lifted:
            self._changed()
        if self.settle_until is not None and (now >= self.settle_until or self._all_expected_back()):
            self._settle(now)

    def _all_expected_back(self) -> bool:
        return self.expected is not None and all(
            name in self.hostset.hosts and self.hostset.hosts[name].lost_at is None for name, _ in self.expected
        )

    def _settle(self, now: float) -> None:
        """The agents had their time to register again: the round's hosts still missing are lost, and only what
        differs from the round's host set (or, never restored, nothing) is news."""
        self.settle_until = None
        missing = self.hostset.record_missing(self.expected or [], now)
        self._set_published(
            list(self.expected) if self.expected is not None else effective(self.hostset.available(), self.max_np)
        )
        self.log.info("settled", hosts=len(self.hostset.hosts), missing=missing, restored=self.expected is not None)
        self._changed()

    # -- queries and commands ------------------------------------------------------------------
    @handles("hosts", roles=(SERVICE, OPERATOR), replayable=True)
    def on_hosts(self, request: Request) -> dict[str, Any]:
        self._publish_change()
        available = self.hostset.available()
        reply = {
            "incarnation": self.incarnation,
            "settling": self.settle_until is not None,
            "version": self.version,
            "timestamp": self.timestamp,
            "available": [[name, list(slots)] for name, slots in available],
            "lost": [r.name for r in self.hostset.hosts.values() if r.lost_at is not None],
            "lost_declared": [r.name for r in self.hostset.hosts.values() if r.lost_at is not None and r.lost_declared],
        }
        if request.body.get("brief") is True:
            records = self.hostset.hosts.values()
            reply["agents"] = {r.name: r.incarnation for r in records if r.lost_at is None}
            reply["marked"] = self.hostset.describe(
                self.clock(), [r for r in records if r.draining or r.blacklist_count or r.blacklisted_until is not None]
            )
            return self.brief.answer(reply, request.body.get("unless"))
        return {
            **reply,
            "published": [[name, list(slots)] for name, slots in self.published],
            "all": self.hostset.describe(self.clock()),
            "excluded": self.pods.excluded if self.pods is not None else [],
        }

    @handles("snapshots", roles=(SERVICE, OPERATOR), replayable=True)
    def on_snapshots(self, request: Request) -> dict[str, Any]:
        records = self.hostset.hosts.values()
        live = [r for r in records if self.hostset.state(r) != LOST]
        return {
            "incarnation": self.incarnation,
            "commits": {r.name: r.snapshots["snapshot"]["commit"] for r in live if r.snapshots.get("snapshot")},
            "usable": any(r.blacklisted_until is None for r in live),
        }

    def _known(self, request: Request) -> str:
        host = field(request.body, "host", str)
        if host not in self.hostset.hosts:
            raise RequestError(
                "unknown_host", f"unknown host {host!r}; known: {', '.join(sorted(self.hostset.hosts)) or 'none'}"
            )
        return host

    @handles("drain", roles=(AGENT, OPERATOR))
    def on_drain(self, request: Request) -> dict[str, Any]:
        return self._set_draining(request, True)

    @handles("undrain", roles=(OPERATOR,))
    def on_undrain(self, request: Request) -> dict[str, Any]:
        return self._set_draining(request, False)

    def _set_draining(self, request: Request, draining: bool) -> dict[str, Any]:
        host = self._known(request)
        with marks_saved(self.hostset, self.marks_log, self.clock):
            self.hostset.set_draining(host, draining)
        self.log.info("host_draining" if draining else "host_undrained", host=host)
        self._changed()
        return {"host": host, "state": self.hostset.state(self.hostset.hosts[host])}

    @handles("blacklist", roles=(SERVICE,))
    def on_blacklist(self, request: Request) -> dict[str, Any]:
        host = self._known(request)
        with marks_saved(self.hostset, self.marks_log, self.clock):
            until = self.hostset.blacklist(host, self.clock(), str(request.body.get("reason", "")))
        self.log.warning(
            "host_blacklisted", host=host, cooldown=None if until is None else round(until - self.clock(), 3)
        )
        self._changed()
        return {"host": host, "cooldown": None if until is None else until - self.clock()}

    @handles("configure", roles=(SERVICE,))
    def on_configure(self, request: Request) -> dict[str, Any]:
        settings = self._checked_settings(request.body)
        with marks_saved(self.hostset, self.marks_log, self.clock):
            self.hostset.pending_marks.clear()
            for record in self.hostset.hosts.values():
                record.blacklisted_until, record.blacklist_count, record.draining = None, 0, False
        self._apply_settings(settings)
        self._read_script(wait=True)
        self.settle_until, self.expected = None, None
        self._set_published(effective(self.hostset.available(), self.max_np))
        return {"incarnation": self.incarnation}

    @handles("restore", roles=(SERVICE,))
    def on_restore(self, request: Request) -> dict[str, Any]:
        marks, expected = (
            bodies.marks(request.body.get("marks"), self.clock(), time.time()),
            bodies.expected(request.body.get("expected")),
        )
        if self.marks_log is not None:
            marks = {}  # the marks kept in etcd, taken at the start, are newer than the registry's
        self._apply_settings(self._checked_settings(request.body))
        self.hostset.restore(marks, [name for name, _ in expected])
        self.expected = expected
        self._read_script(wait=True)
        self.log.info(
            "restored",
            marks=sorted(marks),
            expected=[name for name, _ in expected],
            settling=self.settle_until is not None,
        )
        if self.settle_until is None:
            missing = self.hostset.record_missing(expected, self.clock())
            self.log.info("restored_after_settling", missing=missing)
            self._changed()
        return {"incarnation": self.incarnation}

    def _checked_settings(self, body: dict[str, Any]) -> bodies.Settings:
        settings = bodies.settings(body)
        if self.pods is not None and settings.discovery_script:
            raise RequestError("bad_request", pods_and_script(settings.discovery_script))
        return settings

    def _apply_settings(self, settings: bodies.Settings) -> None:
        self.max_np, self.script.path = settings.max_np, settings.discovery_script
        self.hostset.cooldown_range, self.probation.clean_window = settings.cooldown, settings.probation_clean
        self.hostset.script_hosts = None if self.pods is None else self.pods.hosts() or {}

    # -- discovery script ----------------------------------------------------------------------
    def _poll_script(self) -> None:
        self._read_script(wait=False)

    def _read_script(self, wait: bool) -> None:
        hosts = self.script.run(wait) if self.pods is None else self.pods.take()
        for host in self.hostset.declare_lost(self.pods.take_lost() if self.pods else (), self.clock()):
            self.log.warning("host_lost", host=host, reason="its node is down (Slurm)")
            self._changed()
        if hosts is not None and hosts != self.hostset.script_hosts:
            self.hostset.script_hosts = hosts
            self._changed()

    def _update_metrics(self) -> None:
        """Count hosts by state here, in the loop: the thread serving metrics must not iterate the host set."""
        metrics.count_hosts_by_state([self.hostset.state(record) for record in self.hostset.hosts.values()])

    def close(self) -> None:
        self.script.stop()
        if self.pods is not None:
            self.pods.stop()
        if self.pod_identity is not None:
            self.pod_identity.close()
        super().close()
