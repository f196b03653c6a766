"""Goodput: what the registry's events mean to the job's ledger (services/registry/ledger.py), and the ledger in
words.

- `failure_cause`: the cause of a slot's failure, from its reason (services/registry/exits.py, driver.py): `hang`,
  `lost_host`, else `crash` (a worker's non-zero exit, or its agent restarting);
- `fault_instant`: when a failure began: when the other ranks began waiting for it, else now (a lost host whose
  workers trained on stopped the job at the decision); a lost host's last heartbeat where no waits are known;
- `planned_change`: why a round without a failure is re-joined, read from discovery's brief host list against the
  round's hosts: a host draining (`drain`: `elasticctl drain`, or its agent's SIGTERM), a host that left the list
  without being lost (`preemption`: a pod deleted, a discovery script that dropped it), a round host with fewer
  slots (its slot restarting after a crash: the cause of its last interruption if that was a crash or hang on it),
  a new host or more slots (`scale_up`, or again the crash whose slot came back);
- `headline`: the one line `elasticctl status`, the job's final line and the registry's `job_finished` log show:
  the training share of the wall clock and the three causes that cost most.
"""

from __future__ import annotations

from typing import Any

from elastic_control_plane.services.registry.ledger import (
    CRASH,
    DRAIN,
    HANG,
    LOST_HOST,
    PREEMPTION,
    SCALE_UP,
    Ledger,
)

TOP_CAUSES = 3


def failure_cause(reason: str) -> str:
    if reason.startswith("hung"):
        return HANG
    if reason.startswith("host lost"):
        return LOST_HOST
    return CRASH


def fault_instant(cause: str, now: float, lost_after: float, stalled_s: float | None) -> float:
    """When a failure found `now` began: when the other ranks began waiting in the collective it stalled (`stalled_s`
    ago: an agent killed with its workers is found when its successor registers, seconds after the others stopped).
    A lost host whose workers trained on (its agent frozen, not its workers: no rank waits) stopped the job only now,
    at the decision; where no rank's waits are known (`stalled_s` None: no hang detection), its last heartbeat."""
    if stalled_s is None:
        return now - lost_after if cause == LOST_HOST else now
    return now - stalled_s


def planned_change(ledger: Ledger, round_hosts: list[list[Any]], hosts: dict[str, Any]) -> tuple[str, str, bool] | None:
    """(cause, host, planned) of a change of hosts that makes the round's workers re-join; None: none is seen.
    `planned`: the workers left at a commit (a slot that went down did not: its worker crashed)."""
    available = {name: len(slots) for name, slots in hosts.get("available", [])}
    lost = set(hosts.get("lost", []))
    draining = {row["host"] for row in hosts.get("marked", []) if row.get("draining")}
    in_round = {name: len(slots) for name, slots in round_hosts}
    for name in in_round:
        if name in draining:
            return DRAIN, name, True
    for name in in_round:
        if name not in available and name not in lost:
            return PREEMPTION, name, True
    for name, slots in in_round.items():
        if name in available and available[name] < slots:
            return CRASH, name, False
    for name, slots in available.items():
        if slots > in_round.get(name, 0):
            return _after_fault(ledger, name, SCALE_UP), name, True
    return None


def _after_fault(ledger: Ledger, host: str, cause: str) -> str:
    """A host's slots going and coming back after its own crash or hang are that fault's cost."""
    last = ledger.timeline[-1] if ledger.timeline else None
    if last is not None and last["host"] == host and last["cause"] in (CRASH, HANG):
        return str(last["cause"])
    return cause


def headline(goodput: dict[str, Any]) -> str:
    """`goodput 93.1% of 2.2 min; most lost to crash 5.1s, drain 2.0s, start 1.8s`, from a ledger's view."""
    share = goodput.get("training_share")
    if share is None:
        return "goodput: no time counted yet"
    causes = sorted(((s, cause) for cause, s in goodput["causes"].items() if s >= 0.05), reverse=True)
    top = ", ".join(f"{cause} {seconds:.1f}s" for seconds, cause in causes[:TOP_CAUSES])
    return f"goodput {share:.1%} of {_duration(goodput['wall_s'])}" + (f"; most lost to {top}" if top else "")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
