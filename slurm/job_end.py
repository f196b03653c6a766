"""`elasticctl slurm --wait`: follow a submitted job to its end, its requeues included, as `sbatch --wait` would,
and exit with its code. One job-scoped question to slurmctld (`scontrol show job JOB`) every POLL_INTERVAL seconds.

A job that ends by a signal (cancelled, killed at its time limit) exits 1, as sbatch's does; one slurmctld no longer
knows (it forgets a job MinJobAge after its end: 300 s by default) cannot be told apart, and exits 1 with a line
saying so.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from elastic_control_plane.slurm import commands

POLL_INTERVAL = 5.0  # seconds between two looks: a few RPCs a minute, far inside slurmctld's default rate limit
# The states a job does not leave (a requeued job passes through REQUEUED to PENDING, and is followed on).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
ENDED_HELD = {"SPECIAL_EXIT", "REQUEUE_HOLD"}  # held after a requeue: it runs again only when someone releases it


def exit_status(exit_code: str) -> int:
    """A job's `ExitCode=RC:SIGNAL` as sbatch --wait exits: RC, or 1 where a signal ended it."""
    code, _, signal_number = exit_code.partition(":")
    if not code.isdigit() or (signal_number and signal_number != "0"):
        return 1
    return int(code)


def follow(job_id: str, say: Callable[[str], None], poll: float = POLL_INTERVAL) -> int:
    """Wait for `job_id` to end; its exit status. Each change of its state (and of its run count) is said once."""
    seen = ""
    while True:
        try:
            fields = commands.job_fields(job_id)
        except commands.SlurmError as exc:
            if "has no job" in str(exc):
                say(f"job {job_id}: Slurm no longer knows it (past MinJobAge?): its exit code is lost")
                return 1
            say(f"job {job_id}: {exc}; asking again in {poll:g} s")
            time.sleep(poll)
            continue
        state, restarts = fields.get("JobState", "UNKNOWN"), fields.get("Restarts", "0")
        now = f"{state} (run {int(restarts) + 1 if restarts.isdigit() else restarts})"
        if now != seen:
            say(f"job {job_id}: {now}")
            seen = now
        if state in ENDED or state in ENDED_HELD:
            status = exit_status(fields.get("ExitCode", ""))
            say(f"job {job_id} ended {state}, exit code {fields.get('ExitCode', '?')}: exit {status}")
            return status
        time.sleep(poll)
