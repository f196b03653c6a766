"""The registry's Prometheus metrics and the functions its driver calls to keep them (bus/metrics.py serves them).

Every function is called from the registry's loop (a handler or a driver pass), never
from the thread that serves metrics, and takes plain values, so nothing here
reads the registry's dicts while the loop changes them. Label values are
fixed sets, each series there from the start; a value outside its set is a
programming error (ValueError). Worker states are labelled in lower case.
The one exception is `waited_for`'s `host`: a series per host of the current
round, removed when a round goes on without the host (a host that comes back
starts again from 0, which Prometheus reads as a counter reset), so hosts
that come and go over weeks do not add series forever.

- `job_state(state)`: each time the job's state changes (a submission, and
  services/registry/driver.py's `_begin_round`, `_reset` when it goes back to
  waiting, `finish`).
- `round_started()`: once per round the rendezvous made (`_begin_round`).
- `reset(cause)`: once per reset, where the driver decides on a new round
  (`_reset`, when it goes back to waiting), with why
  (`decisions.reset_cause`): `worker_failed` (a worker exited non-zero or
  hung), `host_lost` (missed heartbeats), `agent_restarted` (the workers died
  with their agent), `hosts_changed` (hosts added, removed or drained, with
  no failure), `resume` (every worker failed; the job resumes from a host's
  snapshot).
- `recovered(seconds)`: when the round after a failure is released
  (`_note_release`, the first pass that sees `released` for the new round),
  with the seconds since the failure was first seen (the first FAILURE of the
  failed round, `_fail_slot` with `first`).
- `workers(counts)`: at the end of every driver pass, with the
  number of slots of the current round in each state
  (`ReportTable.counts()`).
- `goodput(totals)`: at the end of every driver pass, with the job's
  goodput ledger (services/registry/ledger.py `totals`): the seconds of its
  wall clock in each bucket and charged to each cause. Gauges, not counters:
  a bucket can shrink when the ledger moves seconds it had counted as
  training to lost work (or back, for a commit reported late), and a new
  job starts them from 0.

From the agents' `waits` reports (services/registry/waits.py, the service's
`on_waits`):
- `hang_limit(seconds)`: the hang limit the agents are told, on every report
  and at the end of every driver pass (0 while no running job detects hangs).
- `hung_worker()`: once per worker judged hung (a `kill_worker` with a stack
  dump; not again when the kill is resent).
- `waited_for(seconds_by_host)`: on every report, the seconds the other ranks
  waited for each host's ranks over the report's interval; `keep_hosts(hosts)`
  on the first report of each round, with the round's hosts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import Counter, Gauge, Histogram

from elastic_control_plane.services.registry.job import JOB_STATES
from elastic_control_plane.services.registry.ledger import BUCKETS, CAUSES
from elastic_control_plane.services.registry.reports import STATES as WORKER_STATES

RESET_CAUSES = ("worker_failed", "host_lost", "agent_restarted", "hosts_changed", "resume")

JOB_STATE = Gauge("elastic_registry_job_state", "1 for the state the job is in, 0 for the others.", ["state"])
ROUNDS_STARTED = Counter(
    "elastic_registry_rounds_started", "Rounds the registry started (the first one and every reset)."
)
RESETS = Counter("elastic_registry_resets", "Resets (a new round of a running job), by cause.", ["cause"])
RECOVERY_SECONDS = Histogram(
    "elastic_registry_recovery_seconds",
    "Seconds from a failure seen by the registry to the release of the next round.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0),
)
WORKERS = Gauge("elastic_registry_workers", "Slots of the current round by worker state.", ["state"])
HANG_LIMIT = Gauge(
    "elastic_registry_hang_limit_seconds", "The hang limit the agents are told (0: no running job detects hangs)."
)
HUNG_WORKERS = Counter("elastic_registry_hung_workers", "Workers judged hung from their waits and killed.")
PASSES_NOT_SAVED = Counter(
    "elastic_registry_passes_not_saved", "Driver passes whose save the store refused (undone, then redone)."
)
WAITED_FOR = Counter(
    "elastic_worker_waited_for_seconds", "Seconds the other ranks waited for the ranks of a host.", ["host"]
)
GOODPUT_SECONDS = Gauge(
    "elastic_registry_goodput_seconds",
    "Seconds of the job's wall clock in each bucket of its goodput ledger.",
    ["bucket"],
)
GOODPUT_CAUSE_SECONDS = Gauge(
    "elastic_registry_goodput_cause_seconds",
    "Seconds of the job's wall clock its interruptions cost (with their lost work), by cause.",
    ["cause"],
)
_waited_for_hosts: set[str] = set()


def job_state(state: str) -> None:
    _check("job state", state, JOB_STATES)
    for each in JOB_STATES:
        JOB_STATE.labels(each).set(1 if each == state else 0)


def round_started() -> None:
    ROUNDS_STARTED.inc()


def reset(cause: str) -> None:
    RESETS.labels(_check("reset cause", cause, RESET_CAUSES)).inc()


def recovered(seconds: float) -> None:
    RECOVERY_SECONDS.observe(seconds)


def workers(counts: Mapping[str, int]) -> None:
    """`counts`: the number of slots in each worker state (a state left out has none)."""
    for state in counts:
        _check("worker state", state, WORKER_STATES)
    for state in WORKER_STATES:
        WORKERS.labels(state.lower()).set(counts.get(state, 0))


def goodput(totals: Mapping[str, Mapping[str, float]]) -> None:
    """`totals`: a ledger's `totals` (its `buckets` and `causes` in seconds)."""
    for bucket in BUCKETS:
        GOODPUT_SECONDS.labels(bucket).set(totals["buckets"][bucket])
    for cause in CAUSES:
        GOODPUT_CAUSE_SECONDS.labels(cause).set(totals["causes"][cause])


def hang_limit(seconds: float | None) -> None:
    HANG_LIMIT.set(seconds or 0.0)


def hung_worker() -> None:
    HUNG_WORKERS.inc()


def pass_not_saved() -> None:
    PASSES_NOT_SAVED.inc()


def waited_for(seconds_by_host: Mapping[str, float]) -> None:
    for host, seconds in seconds_by_host.items():
        WAITED_FOR.labels(host).inc(seconds)
        _waited_for_hosts.add(host)


def keep_hosts(hosts: Iterable[str]) -> None:
    """A round began on `hosts`: the series of `waited_for` of every other host goes."""
    for host in _waited_for_hosts - set(hosts):
        WAITED_FOR.remove(host)
        _waited_for_hosts.discard(host)


def _check(what: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(allowed)}")
    return value


job_state("none")
workers({})
for _cause in RESET_CAUSES:
    RESETS.labels(_cause)
goodput({"buckets": dict.fromkeys(BUCKETS, 0.0), "causes": dict.fromkeys(CAUSES, 0.0)})
