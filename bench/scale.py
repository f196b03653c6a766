"""Scale benchmark: the four real services against N simulated agents (bench/scale_agents.py) of S slots each.

    python bench/scale.py --hosts 64,256,1024 --slots 8 [--procs 2] [--heartbeat 1.0]

For each size, with fresh services (their own processes, as testing/harness.py `Cluster` starts them):
1. start: the agents register and subscribe; a job for every slot is submitted (`command` ["true"]: the
   simulated workers run nothing); `round_s` is submit -> every worker holds its rank, and
   `last_join_to_round_s` the last join sent -> the last rank received;
2. drain: `drain` of one host sent to discovery; `fanout` is that send -> the `hosts_updated` event's
   arrival at each agent (p50, max), `drain_round_s` the send -> every remaining worker holds a rank in
   the new round;
3. lost host: another agent goes silent; `detect_s` is silence -> the first arrival of the
   `hosts_updated` that removes it, `reset_s` that arrival -> every surviving worker holds a rank in the
   new round;
4. steady: heartbeats answered per second over a window with the job running.
Each service's CPU seconds (utime+stime, /proc/PID/stat) are taken per phase and its peak RSS (VmHWM)
at the end; the simulators' CPU seconds too, to tell the services' cost from the simulator's. Every wait
is on a condition with a deadline. Warnings the services logged (refusals at a bound, say) are counted.

The job's min_np is the slots of N-2 hosts, so the job runs on after the drain and the lost host; the
first round still takes every slot, as all agents are registered before the submit.

The last line, for the largest size: `SCALE hosts=N slots=S round_s=... fanout_p50_ms=... fanout_max_ms=...
reset_s=... cpu_s=... round_cpu_s=... reset_cpu_s=... registry_idle_cores=... discovery_idle_cores=...` (cpu_s:
the services' CPU seconds in the first round; round_cpu_s and reset_cpu_s: theirs in the first round and in the
lost host's phase beyond what they spend idle over as many seconds, the steady phase's rate: what the round and the
reset themselves cost on a machine shared with the simulators; *_idle_cores: what the service kept busy in the
steady phase). With several sizes, each
has its SCALE line, and between two sizes a line compares the growth of the services' CPU for the first
round with that of N log N.

Every process started here is killed, and its temporary directory removed, on the way out, whatever
happens (Ctrl-C and SIGTERM included).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgpack
import zmq

from bench.scale_agents import host_name, raise_fd_limit
from elastic_control_plane.bus.sockets import generate_keys
from elastic_control_plane.elasticctl.local_processes import service_argv
from testing.etcd_cluster import EtcdCluster
from testing.harness import SERVICES, Cluster, wait_for

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CONTROL_REPLY_TIMEOUT = 20.0
POLL_INTERVAL = 0.05  # seconds between two looks at a condition
STEADY_HEARTBEATS = 5  # the steady window, in heartbeat intervals
SIMULATOR = "agent-sim"  # Cluster.close kills processes named agent* first, with SIGKILL


class PhaseFailed(RuntimeError):
    """A condition was not reached within its deadline."""


def _stop(*_: Any) -> None:
    raise SystemExit("scale benchmark terminated")


# -- processes: CPU and memory from /proc --------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_snapshot(pids: dict[str, int]) -> dict[str, float]:
    return {name: cpu_seconds(pid) for name, pid in pids.items()}


def cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


# -- the simulator processes ---------------------------------------------------------------------------
class Simulators:
    """The simulator processes and the control ROUTER they answer on."""

    def __init__(self, cluster: Cluster, hosts: int, slots: int, procs: int) -> None:
        self.cluster = cluster
        self.ctx = zmq.Context()
        self.control = self.ctx.socket(zmq.ROUTER)
        self.control.linger = 0
        # Linux's abstract socket namespace: no file, so no path-length limit however deep the work directory is
        # (a test's under pytest-xdist went past the 107 characters an ipc path may have), and nothing to remove.
        self.endpoint = f"ipc://@elastic-scale-{uuid.uuid4().hex}"
        self.control.bind(self.endpoint)
        self.procs = min(procs, hosts)
        self.hosts, self.slots = hosts, slots
        self.first = [hosts * i // self.procs for i in range(self.procs + 1)]
        self.routes: dict[int, bytes] = {}

    def start(self) -> None:
        for proc in range(self.procs):
            first, count = self.first[proc], self.first[proc + 1] - self.first[proc]
            args = [
                "--proc",
                str(proc),
                "--first",
                str(first),
                "--count",
                str(count),
                "--slots",
                str(self.slots),
                "--control",
                self.endpoint,
            ]
            self.cluster.spawn(f"{SIMULATOR}-{proc}", [sys.executable, "-m", "bench.scale_agents", *args])

    @property
    def pids(self) -> dict[str, int]:
        return {f"{SIMULATOR}-{p}": self.cluster.processes[f"{SIMULATOR}-{p}"].pid for p in range(self.procs)}

    def owner(self, host_index: int) -> int:
        return next(p for p in range(self.procs) if self.first[p] <= host_index < self.first[p + 1])

    def wait_hello(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.routes) < self.procs:
            self._check_alive()
            route, answer = self._receive(deadline, "every simulator to open its sockets")
            if answer["op"] == "hello":
                self.routes[answer["proc"]] = route

    def ask(self, op: str, procs: list[int] | None = None, **body: Any) -> list[dict[str, Any]]:
        """Send `op` to simulators (all by default) and return their answers, in process order."""
        targets = list(range(self.procs)) if procs is None else procs
        for proc in targets:
            self.control.send_multipart([self.routes[proc], msgpack.packb({"op": op, **body}, use_bin_type=True)])
        answers: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + CONTROL_REPLY_TIMEOUT
        while len(answers) < len(targets):
            _, answer = self._receive(deadline, f"the simulators' answers to {op!r}")
            if answer["op"] == op:
                answers[answer["proc"]] = answer
        return [answers[p] for p in targets]

    def total(self, op: str, key: str, **body: Any) -> int:
        return sum(answer[key] for answer in self.ask(op, **body))

    def _receive(self, deadline: float, what: str) -> tuple[bytes, dict[str, Any]]:
        while (left := deadline - time.monotonic()) > 0:
            if self.control.poll(int(min(left, 1.0) * 1000) + 1):
                route, payload = self.control.recv_multipart()
                return route, msgpack.unpackb(payload, raw=False)
            self._check_alive()
        raise PhaseFailed(f"no answer from the simulators: waited for {what}")

    def _check_alive(self) -> None:
        for name in self.pids:
            code = self.cluster.processes[name].poll()
            if code is not None:
                raise PhaseFailed(f"{name} exited with code {code}: {self.cluster.output(name)[-2000:]}")

    def close(self) -> None:
        self.control.close(linger=0)
        self.ctx.term()


# -- results -------------------------------------------------------------------------------------------
@dataclass
class SizeResult:
    hosts: int
    slots: int
    store: str = "sqlite"
    lines: list[str] = field(default_factory=list)
    numbers: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> process -> seconds
    wall: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    rss: dict[str, float] = field(default_factory=dict)

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    def services_cpu(self, phase: str) -> float:
        return sum(self.cpu[phase][name] for name in SERVICES)

    def idle_cores(self, name: str) -> float:
        """The cores `name` kept busy in the steady phase (heartbeats, the driver's idle passes)."""
        return self.cpu["steady"][name] / self.wall["steady"]

    def above_idle(self, phase: str) -> float:
        """The services' CPU seconds in `phase` beyond what they spend idle (the steady phase's rate: heartbeats,
        the driver's passes) over its wall seconds: what the phase's round itself cost."""
        idle = sum(self.idle_cores(name) for name in SERVICES)
        return self.services_cpu(phase) - idle * self.wall[phase]

    def scale_line(self) -> str:
        n = self.numbers
        return (
            f"SCALE hosts={self.hosts} slots={self.slots} store={self.store} round_s={n['round_s']:.3f} "
            f"fanout_p50_ms={n['fanout_p50_ms']:.1f} "
            f"fanout_max_ms={n['fanout_max_ms']:.1f} reset_s={n['reset_s']:.3f} "
            f"cpu_s={self.services_cpu('first round'):.2f} round_cpu_s={self.above_idle('first round'):.2f} "
            f"reset_cpu_s={self.above_idle('lost host'):.2f} "
            f"registry_idle_cores={self.idle_cores('registry'):.3f} "
            f"discovery_idle_cores={self.idle_cores('discovery'):.3f}"
        )


def deadline_for(workers: int) -> float:
    """How long any one phase may take: generous, and longer for larger clusters."""
    return 60.0 + workers / 100


# -- one size ------------------------------------------------------------------------------------------
class ScaleRun:
    """One size: fresh services, simulators, the phases, and the numbers."""

    def __init__(
        self,
        workdir: Path,
        hosts: int,
        slots: int,
        procs: int,
        heartbeat: float,
        store: str = "sqlite",
        store_url: str | None = None,
        keys: Path | None = None,
    ) -> None:
        timing = {
            "ELASTIC_HEARTBEAT": str(heartbeat),
            "ELASTIC_MISSED_HEARTBEATS": "3",
            "ELASTIC_DISCOVERY_POLL": "1.0",
            "ELASTIC_DRIVER_TICK": "0.1",
            **({"ELASTIC_STORE": store_url} if store_url else {}),
            **({"ELASTIC_KEYS": str(keys)} if keys else {}),
        }
        self.cluster = Cluster(workdir, timing)
        self.simulators = Simulators(self.cluster, hosts, slots, procs)
        self.hosts, self.slots, self.heartbeat = hosts, slots, heartbeat
        self.workers = hosts * slots
        self.deadline = deadline_for(self.workers)
        self.result = SizeResult(hosts, slots, store)
        self.drained, self.lost = hosts - 1, hosts - 2
        self.round = 0
        self._phase_name = "start"
        self._phase_started: dict[str, float] | None = None
        self._measure_started: dict[str, float] = {}
        self._phase_wall = self._measure_wall = 0.0

    def close(self) -> None:
        try:
            self.cluster.close()
        finally:
            self.simulators.close()

    @property
    def service_pids(self) -> dict[str, int]:
        return {name: self.cluster.processes[name].pid for name in SERVICES}

    def _all_pids(self) -> dict[str, int]:
        return {**self.service_pids, **self.simulators.pids}

    def wait(self, probe: Callable[[], Any], what: str, timeout: float | None = None) -> Any:
        """Poll `probe` until it returns something truthy; PhaseFailed after the deadline, or at once when the probe
        raises it (a condition that can no longer be met)."""
        timeout = timeout or self.deadline
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = probe()
            if value:
                return value
            time.sleep(POLL_INTERVAL)
        raise PhaseFailed(f"timed out after {timeout:g}s waiting for {what}")

    def run(self) -> SizeResult:
        say = self.result.say
        say(
            f"== {self.hosts} hosts x {self.slots} slots = {self.workers} workers ({self.simulators.procs} "
            f"simulator processes, heartbeat {self.heartbeat:g} s, {self.result.store} store) =="
        )
        try:
            self._measure()
        except PhaseFailed:
            self._report_after_failure()
            raise
        say(self.result.scale_line())
        return self.result

    def _measure(self) -> None:
        self._start()
        self._phase_started = self._measure_started = cpu_snapshot(self._all_pids())
        self._phase_wall = self._measure_wall = time.monotonic()
        for name, phase in (
            ("first round", self._first_round),
            ("drain", self._drain),
            ("lost host", self._lose_host),
            ("steady", self._steady),
        ):
            self._phase_name = name
            phase()
            self._end_phase(name)
        self._report_costs()
        self._report_counters()
        self._report_decisions()
        self._report_service_warnings()

    def _end_phase(self, name: str) -> None:
        """Charge the CPU since the last phase ended to `name`; keep the totals and peak RSS up to date."""
        now, wall = cpu_snapshot(self._all_pids()), time.monotonic()
        self.result.cpu.pop("total", None)
        self.result.cpu[name] = cpu_delta(now, self._phase_started)
        self.result.cpu["total"] = cpu_delta(now, self._measure_started)
        self.result.wall.pop("total", None)
        self.result.wall[name] = wall - self._phase_wall
        self.result.wall["total"] = wall - self._measure_wall
        self.result.rss = {name: peak_rss_mib(pid) for name, pid in self._all_pids().items()}
        self._phase_started, self._phase_wall = now, wall

    def _report_after_failure(self) -> None:
        """The CPU spent, what the simulators counted and what the services warned of, when a phase did not finish."""
        if self._phase_started is not None:
            self._end_phase(f"{self._phase_name} (failed)")
            self._report_costs()
        try:
            self._report_counters()
        except PhaseFailed as exc:
            self.result.say(f"simulators: no counters ({exc})")
        self._report_service_warnings()

    # -- phases --------------------------------------------------------------------------------------
    def _start(self) -> None:
        """Simulators first (their sockets take seconds to make), then the services; the agents connect and register
        at once, while discovery is still settling: a registration then publishes nothing."""
        self.simulators.start()
        self.simulators.wait_hello(self.deadline)
        started = time.monotonic()
        for service in SERVICES:
            self.cluster.spawn(service, service_argv(service))
        for service in SERVICES:
            wait_for(lambda s=service: self.cluster.call(s, "ping", timeout=0.5), 20, f"{service} to answer")
        connected = time.monotonic()
        self.simulators.ask("connect")
        self.wait(lambda: self._state_total("registered") == self.hosts, f"{self.hosts} agents to register")
        registered = time.monotonic()
        settling = self.cluster.call("discovery", "hosts", timeout=10)["settling"]
        self.wait(
            lambda: self._state_total("subscribed") == self.hosts,
            f"{self.hosts} agents to receive a notifier heartbeat",
        )
        early = sum(s["events_seen"].get("hosts_updated", 0) for s in self.simulators.ask("state"))
        self.result.say(
            f"start: services up in {connected - started:.2f} s, then {self.hosts} agents registered in "
            f"{registered - connected:.2f} s "
            f"(discovery still settling then: {'yes' if settling else 'NO, so registrations published hosts_updated'}; "
            f"hosts_updated received before the submit: {early})"
        )

    def start_job(self) -> None:
        """The services, the agents and a job on every slot, up to its first round (a hook for benches that go on
        from there, as bench/etcd_size.py does)."""
        self._start()
        self._first_round()

    def wait_new_round(self, expected: int, what: str) -> None:
        """Wait until `expected` workers hold a rank in a round newer than the last one seen; that round is then the
        last one seen."""
        self.round = self._wait_ranks(self.round, expected, what)["round"]

    def _state_total(self, key: str) -> int:
        return self.simulators.total("state", key)

    def _ranks_above(self, round_number: int) -> dict[str, Any]:
        answers = self.simulators.ask("ranks", above=round_number)
        refused = Counter[str]()
        for answer in answers:
            refused.update({code: n for code, n in answer["join_errors"].items() if not code.endswith(":superseded")})
        if refused:
            raise PhaseFailed(f"the rendezvous refused joins, so the round cannot complete: {dict(refused)}")
        answers = [a for a in answers if a["count"]]
        return {
            "count": sum(a["count"] for a in answers),
            "round": max((a["round"] for a in answers), default=0),
            "last_rank_at": max((a["last_rank_at"] for a in answers), default=0.0),
            "first_rank_at": min((a["first_rank_at"] for a in answers), default=0.0),
            "last_join_sent_at": max((a["last_join_sent_at"] for a in answers), default=0.0),
        }

    def _wait_ranks(self, above: int, expected: int, what: str) -> dict[str, Any]:
        return self.wait(lambda: (r := self._ranks_above(above))["count"] == expected and r, what)

    def _arrivals(self, event: str, after: float, expected: int, what: str) -> list[list[float]]:
        """[arrived, published] of the first `event` after `after` at each of `expected` agents."""

        def probe() -> list[list[float]] | None:
            times = [t for answer in self.simulators.ask("arrivals", event=event, after=after) for t in answer["times"]]
            return times if len(times) == expected else None

        return self.wait(probe, what)

    def _timeline(self, start: float, events: tuple[str, ...], ranks: dict[str, Any], above: int) -> None:
        """Where a phase's time went, in seconds after `start`: each event's publication by the notifier and its
        arrival at the agents (first, median, last; a `round` event of a round after `above`), the last join sent,
        the first and last rank received."""
        parts = []
        for event in events:
            only_after = above if event == "round" else -1
            pairs = [
                pair
                for answer in self.simulators.ask("arrivals", event=event, after=start, above=only_after)
                for pair in answer["times"]
            ]
            if pairs:
                arrived = sorted(a - start for a, _ in pairs)
                published = min(p for _, p in pairs) - start
                parts.append(
                    f"{event} published +{published:.3f}, at agents "
                    f"+{arrived[0]:.3f}/+{statistics.median(arrived):.3f}/+{arrived[-1]:.3f}"
                )
        parts.append(f"last join sent +{ranks['last_join_sent_at'] - start:.3f}")
        parts.append(f"ranks +{ranks['first_rank_at'] - start:.3f}..+{ranks['last_rank_at'] - start:.3f}")
        self.result.say("  timeline (s; arrivals first/median/last): " + "; ".join(parts))

    def _first_round(self) -> None:
        spec = {"command": ["true"], "min_np": (self.hosts - 2) * self.slots, "hung_timeout": 3600.0}
        submitted = time.time()
        self.cluster.call("registry", "submit", {"spec": spec}, timeout=30)
        ranks = self._wait_ranks(0, self.workers, f"all {self.workers} workers to hold a rank")
        self.round = ranks["round"]
        n = self.result.numbers
        n["round_s"] = ranks["last_rank_at"] - submitted
        n["last_join_to_round_s"] = ranks["last_rank_at"] - ranks["last_join_sent_at"]
        self.result.say(
            f"round {self.round}: round_s={n['round_s']:.3f} (submit -> all {self.workers} workers hold their rank); "
            f"last_join_to_round_s={n['last_join_to_round_s']:.3f} (last join sent -> last rank received)"
        )
        self._timeline(submitted, ("round",), ranks, 0)

    def _drain(self) -> None:
        host = host_name(self.drained)
        sent = time.time()
        self.cluster.call("discovery", "drain", {"host": host}, timeout=10)
        arrivals = self._arrivals(
            "hosts_updated", sent, self.hosts, f"every agent to receive hosts_updated after the drain of {host}"
        )
        latencies_ms = sorted((arrived - sent) * 1000 for arrived, _ in arrivals)
        published_ms = (arrivals[0][1] - sent) * 1000
        remaining = (self.hosts - 1) * self.slots
        before = self.round
        ranks = self._wait_ranks(before, remaining, f"the {remaining} remaining workers to hold a rank in a new round")
        self.round = ranks["round"]
        n = self.result.numbers
        n["fanout_p50_ms"], n["fanout_max_ms"] = statistics.median(latencies_ms), latencies_ms[-1]
        n["drain_round_s"] = ranks["last_rank_at"] - sent
        self.result.say(
            f"drain {host}: hosts_updated fanout p50 {n['fanout_p50_ms']:.1f} ms, max {n['fanout_max_ms']:.1f} "
            f"ms over {len(arrivals)} agents "
            f"(the notifier published it {published_ms:.1f} ms after the drain was sent); "
            f"drain_round_s={n['drain_round_s']:.3f} (drain sent -> {remaining} workers hold a rank in round "
            f"{self.round})"
        )
        self._timeline(sent, ("hosts_updated", "round"), ranks, before)

    def _lose_host(self) -> None:
        host = host_name(self.lost)
        silent = time.time()
        self.simulators.ask("lose", procs=[self.simulators.owner(self.lost)], host=host)
        arrivals = self._arrivals(
            "hosts_updated", silent, self.hosts - 1, f"the agents to receive hosts_updated after {host} went silent"
        )
        first = min(arrived for arrived, _ in arrivals)
        survivors = (self.hosts - 2) * self.slots
        before = self.round
        ranks = self._wait_ranks(before, survivors, f"the {survivors} surviving workers to hold a rank in a new round")
        self.round = ranks["round"]
        n = self.result.numbers
        n["detect_s"], n["reset_s"] = first - silent, ranks["last_rank_at"] - first
        self.result.say(
            f"lost {host}: hosts_updated first arrived {n['detect_s']:.2f} s after it went silent (lost after "
            f"{3 * self.heartbeat:g} s); "
            f"reset_s={n['reset_s']:.3f} (that arrival -> {survivors} workers hold a rank in round {self.round})"
        )
        self._timeline(silent, ("hosts_updated", "abort", "round"), ranks, before)

    def _steady(self) -> None:
        window = STEADY_HEARTBEATS * self.heartbeat
        answered = self._state_total("heartbeats_ok")
        started = time.monotonic()
        time.sleep(window)  # the measurement window itself
        rate = (self._state_total("heartbeats_ok") - answered) / (time.monotonic() - started)
        self.result.numbers["heartbeats_per_s"] = rate
        live = self.hosts - 1
        self.result.say(
            f"steady: {rate:.1f} heartbeats/s answered over {window:g} s ({live} live agents, "
            f"{live / self.heartbeat:.1f}/s expected)"
        )

    # -- reports -------------------------------------------------------------------------------------
    def _report_costs(self) -> None:
        say, cpu = self.result.say, self.result.cpu
        phases = list(cpu)
        say(f"  {'CPU seconds':<22}" + "".join(f"{p:>12}" for p in phases) + f"{'peak RSS MiB':>14}")
        say(f"  {'(wall seconds)':<22}" + "".join(f"{self.result.wall[p]:>12.2f}" for p in phases))
        for name in [*SERVICES, *self.simulators.pids]:
            say(f"  {name:<22}" + "".join(f"{cpu[p][name]:>12.2f}" for p in phases) + f"{self.result.rss[name]:>14.1f}")
        say(f"  {'services':<22}" + "".join(f"{self.result.services_cpu(p):>12.2f}" for p in phases))
        say(f"  {'simulators':<22}" + "".join(f"{sum(cpu[p][s] for s in self.simulators.pids):>12.2f}" for p in phases))
        idle = ", ".join(f"{name} {self.result.idle_cores(name):.3f}" for name in SERVICES)
        say(
            f"services' CPU seconds beyond idle: first round {self.result.above_idle('first round'):.2f}, drain "
            f"{self.result.above_idle('drain'):.2f}, lost host {self.result.above_idle('lost host'):.2f}; idle cores "
            f"(steady): {idle}"
        )

    def _report_counters(self) -> None:
        states = self.simulators.ask("state")
        total: Counter[str] = Counter()
        errors: Counter[str] = Counter()
        refused: Counter[str] = Counter()
        for state in states:
            total.update(
                {
                    k: state[k]
                    for k in (
                        "entries_sent",
                        "entries_resent",
                        "workers_removed",
                        "events_missed",
                        "ranks_checked",
                        "rank_mismatches",
                        "sends_dropped",
                    )
                }
            )
            errors.update(state["errors"])
            refused.update(state["heartbeats_refused"])
        self.result.say(
            "simulators: "
            + ", ".join(f"{k}={v}" for k, v in total.items())
            + f"; heartbeats not ok: {dict(refused) or 'none'}; error replies: {dict(errors) or 'none'}"
        )

    def _report_decisions(self) -> None:
        """The registry's decisions, one per reset: why each new round was started."""
        status = self.cluster.call("registry", "status", timeout=10)
        decisions = "; ".join(
            f"round {d['round']}: {d['action']} ({d['reason'][:80] or 'hosts changed'})" for d in status["history"]
        )
        skipped = status["round"] - 1 - status["resets"]
        self.result.say(
            f"registry: round {status['round']}, {status['resets']} resets ({skipped} round numbers used by "
            "rounds the registry did not start: "
            f"a new_round it gave up on); decisions: {decisions or 'none'}"
        )

    def _report_service_warnings(self) -> None:
        """Count the warnings and errors each service logged, by event and code."""
        found: Counter[str] = Counter()
        for name in SERVICES:
            for line in self.cluster.output(name).splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("level") in ("warning", "error", "critical"):
                    found[f"{name}:{record.get('event')}" + (f":{record['code']}" if "code" in record else "")] += 1
        self.result.say("service warnings: " + (", ".join(f"{k} x{v}" for k, v in found.most_common()) or "none"))


def keep_logs(workdir: Path, into: Path, hosts: int, slots: int) -> None:
    """Copy the processes' logs of one size to `into`/HOSTSxSLOTS/."""
    target = into / f"{hosts}x{slots}"
    target.mkdir(parents=True, exist_ok=True)
    for log in workdir.glob("*.log"):
        shutil.copy(log, target / log.name)


def run_size(
    hosts: int, slots: int, procs: int, heartbeat: float, logs: Path | None, store: str, curve: bool = False
) -> SizeResult:
    """One size on fresh services; with `store` etcd, their hard state in a fresh 3-member etcd on loopback (etcd-tls:
    over mutual TLS). `curve`: every socket with CURVE keys (a fresh keys directory)."""
    with tempfile.TemporaryDirectory(prefix="elastic-scale-") as tmp:
        etcd = EtcdCluster(Path(tmp) / "etcd", tls=store == "etcd-tls") if store.startswith("etcd") else None
        keys = None
        if curve:  # beside the etcd certificates, where there are some: the services then speak TLS to etcd
            keys = etcd.keys_dir if etcd is not None and etcd.tls is not None else Path(tmp) / "keys"
            generate_keys(keys)
        try:
            if etcd is not None:
                etcd.start()
            store_url = etcd.store_url if etcd else None
            run = ScaleRun(Path(tmp), hosts, slots, procs, heartbeat, store, store_url, keys)
            try:
                return run.run()
            finally:
                run.close()
                if logs is not None:
                    keep_logs(Path(tmp), logs, hosts, slots)
        finally:
            if etcd is not None:
                etcd.stop()


def n_log_n(n: int) -> float:
    return n * math.log(n)


def sizes(text: str) -> list[int]:
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of host counts") from None
    if not values or values[0] < 3:
        raise argparse.ArgumentTypeError("each size needs at least 3 hosts (one is drained, one lost)")
    return values


def stores(text: str) -> list[str]:
    chosen = [part for part in text.split(",") if part]
    unknown = sorted(set(chosen) - {"sqlite", "etcd", "etcd-tls"})
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: stores are sqlite, etcd and etcd-tls")
    return chosen


def results(args: argparse.Namespace) -> Iterator[SizeResult]:
    previous: SizeResult | None = None
    for hosts in args.hosts:
        by_store = {}
        curve = "etcd-tls" in args.store  # the same sockets in every arm: the ratio is TLS's alone
        for store in args.store:
            by_store[store] = result = run_size(
                hosts, args.slots, args.procs, args.heartbeat, args.keep_logs, store, curve
            )
        for label, pair in (("STORE", ("sqlite", "etcd")), ("TLS", ("etcd", "etcd-tls"))):
            if set(pair) <= set(by_store):
                base, other = by_store[pair[0]].numbers, by_store[pair[1]].numbers
                print(
                    f"{label} hosts={hosts} slots={args.slots} {pair[1]}/{pair[0]}: "
                    f"round_s x{other['round_s'] / base['round_s']:.2f} "
                    f"reset_s x{other['reset_s'] / base['reset_s']:.2f}",
                    flush=True,
                )
        if previous is not None:
            cpu_ratio = result.services_cpu("first round") / max(previous.services_cpu("first round"), 1e-9)
            print(
                f"scaling {previous.hosts} -> {hosts} hosts: services' CPU for the first round x{cpu_ratio:.2f}, "
                f"N log N x{n_log_n(hosts) / n_log_n(previous.hosts):.2f}, N x{hosts / previous.hosts:.2f}",
                flush=True,
            )
        previous = result
        yield result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--hosts",
        type=sizes,
        default=sizes("64"),
        help="Simulated hosts; a comma list runs each size with fresh services.",
    )
    parser.add_argument("--slots", type=int, default=8, help="Slots (workers) per host.")
    parser.add_argument(
        "--store",
        type=stores,
        default=["sqlite"],
        help="sqlite, etcd, etcd-tls, or a comma list: where the services keep their state (etcd: a fresh 3-member "
        "etcd on 127.0.0.1-3 per size; etcd-tls: over mutual TLS, and then every arm with CURVE keys); each size "
        "runs on each, a STORE line compares etcd with sqlite and a TLS line etcd-tls with etcd.",
    )
    parser.add_argument("--procs", type=int, default=2, help="Simulator processes the agents are spread over.")
    parser.add_argument(
        "--heartbeat", type=float, default=1.0, help="Heartbeat interval in seconds (services and agents)."
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="Copy the services' and simulators' logs here (DIR/HOSTSxSLOTS/).",
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop)
    limit = raise_fd_limit()
    needed = (
        6 * math.ceil(max(args.hosts) / args.procs) + 100
    )  # per simulator: 3 sockets an agent, each a socket fd and a mailbox fd
    if needed > limit:
        print(f"warning: a simulator process needs about {needed} file descriptors; the limit is {limit}", flush=True)
    done: list[SizeResult] = []
    try:
        for result in results(args):
            done.append(result)
    except PhaseFailed as exc:
        print(f"FAILED: {exc}", flush=True)
        sys.exit(1)
    if len(done) > 1:
        print(done[-1].scale_line(), flush=True)


if __name__ == "__main__":
    main()
