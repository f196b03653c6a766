"""What the batch script does when its run ends: finish, requeue, or stop the requeue loop.

The driver (slurm/batch.py) exits with one of these codes and the batch script checks it: REQUEUE makes the script
run `scontrol requeue` (and exclude the hosts the job gave up on); any other code ends the job with it, so a job
that finished (0) or keeps failing without progress is not started again.
"""

from __future__ import annotations

from dataclasses import dataclass

FINISHED = 0
REQUEUE = 75  # EX_TEMPFAIL: checkpointed, run me again
GAVE_UP = 93  # failed again without a new commit (NVIDIA's resiliency extension stops its job chain on 93 too)
SIGNAL_EXIT = 128  # a shell's exit code for a process killed by signal N is 128 + N


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    reason: str

    @property
    def requeue(self) -> bool:
        return self.exit_code == REQUEUE


def decide(
    job_exit: int | None, preempted: bool, restarts: int, max_requeues: int, commit_before: int, commit_after: int
) -> Outcome:
    """The end of one run of the batch script.

    job_exit: `elasticctl run`'s exit code (None: it did not end on its own: the driver stopped it, preempted);
    preempted: the batch shell got the signal before the limit (or `scancel --signal=USR1`);
    restarts: SLURM_RESTART_COUNT; commit_before / commit_after: the newest checkpoint's commit when this run started
    and now (0: none)."""
    if job_exit == FINISHED and not preempted:
        return Outcome(FINISHED, "the job finished")
    if restarts >= max_requeues:
        return Outcome(
            job_exit if job_exit else GAVE_UP, f"requeued {restarts} times already (--max-requeues {max_requeues})"
        )
    if preempted:
        where = f"checkpoint at commit {commit_after}" if commit_after else "no commit yet: the rerun starts afresh"
        return Outcome(REQUEUE, f"preempted: {where}, requeued")
    if commit_after > commit_before:
        return Outcome(REQUEUE, f"the job failed (exit {job_exit}) after commit {commit_after}: requeued to resume")
    return Outcome(
        GAVE_UP, f"the job failed (exit {job_exit}) with no commit since the last start ({commit_before}): not requeued"
    )
