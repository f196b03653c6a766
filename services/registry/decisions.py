"""What the driver does once every slot of a round has reported (Horovod's WorkerStateRegistry, made pure), and
why a round it resumes is reset.

Each slot of a round ends as READY (its worker re-joined for the next round),
SUCCESS (exit 0) or FAILURE (non-zero exit, lost host, hung). Then: any SUCCESS
ends the job successfully; all FAILURE ends it with "all hosts failed"; hosts
with a failure are blacklisted; the reset limit ends it; otherwise a new round.

Two departures from Horovod:
- a worker that crashed under a live agent which restarts its slot in place
  (`host_stays`) does not get its host blacklisted; the agent's restart policy
  decides when a crashing slot costs its host;
- when every worker failed but a host still holds a snapshot of a commit newer
  than the one the job last resumed from, and a host whose slots restart in
  place (so its agent keeps its snapshot) is among them, the job resumes
  from it (a reset, within the reset limit) instead of failing; failing again
  with no commit since ends it as Horovod would. With `--max-restarts 0`
  every failed host is given up, so the job fails as in Horovod.

In torchrun mode, as in torchrun: every failure is a restart of every
worker, however many failed (the others' collectives fail with the first),
and the reset limit (torchrun's --max-restarts) counts the restarts after a
failure, not those after a change of hosts.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from elastic_control_plane.services.registry.reports import FAILURE, SUCCESS, Slot, SlotReport


@dataclass(frozen=True)
class Decision:
    action: str  # "succeed" | "fail" | "resume"
    reason: str = ""
    exit_code: int = 0
    blacklist: list[str] = field(default_factory=list)
    resume_from: int = 0


def decide(
    reports: Mapping[Slot, SlotReport],
    resets: int,
    reset_limit: int | None,
    newest_snapshot: int = 0,
    resumed_from: int = 0,
    torchrun: bool = False,
) -> Decision:
    """`newest_snapshot`: the newest commit held in a live host's snapshot (0: none); `resumed_from`: the commit the
    job last resumed from after every worker failed (0: never). `torchrun`: the job runs in torchrun mode, where
    `resets` counts the restarts after a failure only and the reset limit bounds those alone, and where every
    worker failing is an ordinary restart (one worker's failure brings the others' collectives down)."""
    failures = {slot: r for slot, r in reports.items() if r.state == FAILURE}
    if any(r.state == SUCCESS for r in reports.values()):
        return Decision("succeed", "job finished")
    details = "; ".join(r.describe(slot) for slot, r in sorted(failures.items(), key=lambda kv: kv[1].rank))
    first_code = next((r.exit_code for r in sorted(failures.values(), key=lambda r: r.failed_order) if r.exit_code), 1)
    exit_code = first_code if first_code > 0 else 1
    all_failed = bool(failures) and len(failures) == len(reports)
    keeps_a_snapshot = any(r.host_stays for r in failures.values())
    if all_failed and not torchrun and (newest_snapshot <= resumed_from or not keeps_a_snapshot):
        again = f" again at commit {resumed_from}, with no commit since the last resume" if resumed_from else ""
        return Decision("fail", f"all hosts failed{again}: {details}", exit_code=exit_code)
    if reset_limit is not None and resets >= reset_limit and (failures or not torchrun):
        why = f" (last: {details})" if details else ""
        return Decision("fail", f"reset limit {reset_limit} reached after {resets} reset(s){why}", exit_code=exit_code)
    blacklist = sorted({slot[0] for slot, r in failures.items() if not r.host_stays})
    if all_failed and not torchrun:
        return Decision(
            "resume",
            f"every worker failed; resuming from the snapshot of commit {newest_snapshot}: {details}",
            blacklist=blacklist,
            resume_from=newest_snapshot,
        )
    return Decision("resume", details, blacklist=blacklist)


def reset_cause(decision: Decision, failure_reasons: Iterable[str]) -> str:
    """Why a round that resumes is reset, for the registry's metrics (metrics.RESET_CAUSES)."""
    if decision.resume_from:
        return "resume"
    reasons = list(failure_reasons)
    if not reasons:
        return "hosts_changed"
    if any(reason.startswith("host lost") for reason in reasons):
        return "host_lost"
    if any(reason.startswith("its agent restarted") for reason in reasons):
        return "agent_restarted"
    return "worker_failed"
