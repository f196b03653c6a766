"""Submit a job and follow it to its end: a progress line per change, the job's exit code at the end.

Following rides through control-plane outages: while the registry does not answer, polls back off (0.25 s doubling
to 2 s), with one line when the outage starts and one when it ends. Ctrl-C cancels the job as soon as the registry
answers; if it does not answer within CANCEL_WAIT seconds, or Ctrl-C comes again first, elasticctl exits 130 and
the job may still be running. A registry that answers for another job (it lost its state) ends the follow.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import click

from elastic_control_plane.elasticctl.control import CommandError, ControlPlane, ControlPlaneUnreachable
from elastic_control_plane.elasticctl.outage import Outage

POLL_INTERVAL = 0.25
CANCEL_WAIT = 30.0
CANCEL_REASON = "cancelled by elasticctl (interrupted)"


def progress_line(job: dict[str, Any]) -> str:
    return (
        f"[elasticctl] job {job['job']} {job['state']}: round {job['round']}, world size {job['size']}, resets "
        f"{job['resets']}"
    )


def _say(line: str) -> None:
    click.echo(line, err=True)


class Interrupts:
    """Ctrl-C presses since the registry last accepted a cancel."""

    def __init__(self) -> None:
        self.count = 0
        self.first_at = 0.0
        self.announced = False

    def press(self, *_: Any) -> None:
        if self.count == 0:
            self.first_at = time.monotonic()
        self.count += 1

    def clear(self) -> None:
        self.count = 0
        self.announced = False


def submit_and_follow(plane: ControlPlane, spec: dict[str, Any], run_id: str | None = None) -> int:
    """Submit `spec` (as run `run_id`: the registry's job, if it is that run already, is followed instead) and follow
    it to its end."""
    spec = {**spec, "cwd": spec.get("cwd") or os.getcwd()}
    submitted = plane.call("registry", "submit", {"spec": spec, **({"run_id": run_id} if run_id else {})})
    job_id = submitted["job"]
    if submitted.get("attached"):
        _say(f"[elasticctl] job {job_id} is run {run_id} already: following it")
    else:
        _say(f"[elasticctl] job {job_id} submitted: {' '.join(spec['command'])}")
    interrupts = Interrupts()
    previous = signal.signal(signal.SIGINT, interrupts.press)
    try:
        return follow(plane, job_id, interrupts)
    finally:
        signal.signal(signal.SIGINT, previous)


def follow(plane: ControlPlane, job_id: int, interrupts: Interrupts) -> int:
    """Poll the registry until job `job_id` ends; return its exit code."""
    outage = Outage(_say)
    last = ""
    while True:
        try:
            if interrupts.count:
                plane.call("registry", "cancel", {"reason": CANCEL_REASON})
                interrupts.clear()
            job = plane.call("registry", "job")
        except ControlPlaneUnreachable as exc:
            wait = outage.failed(exc)
            if interrupts.count and not interrupts.announced:
                _say(
                    f"[elasticctl] job {job_id} will be cancelled when the registry answers (waiting at most "
                    f"{CANCEL_WAIT:g}s; Ctrl-C again to stop waiting)"
                )
                interrupts.announced = True
            _pause(wait, interrupts, job_id)
            continue
        outage.answered()
        if job["job"] != job_id:
            raise CommandError(_lost_job(job_id, job))
        if job["state"] in ("succeeded", "failed"):
            _say(
                f"[elasticctl] job {job_id} {job['state']} after {job['resets']} reset(s): {job['reason']} (exit "
                f"code {job['exit_code']}); {job.get('goodput') or 'no goodput ledger'}"
            )
            return int(job["exit_code"] or 0)
        line = progress_line(job)
        if line != last:
            _say(line)
            last = line
        time.sleep(POLL_INTERVAL)


def _pause(seconds: float, interrupts: Interrupts, job_id: int) -> None:
    """Wait before the next try; give up on an unanswered Ctrl-C after CANCEL_WAIT seconds or a second Ctrl-C."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if interrupts.count >= 2:
            raise CommandError(
                f"interrupted again before the registry answered; job {job_id} may still be running", 130
            )
        if interrupts.count and time.monotonic() - interrupts.first_at > CANCEL_WAIT:
            raise CommandError(
                f"the registry did not answer within {CANCEL_WAIT:g}s of Ctrl-C; job {job_id} may still be running", 130
            )
        time.sleep(0.05)


def _lost_job(job_id: int, job: dict[str, Any]) -> str:
    if not job["job"]:
        return f"job {job_id} is no longer known to the registry, which now has no job (it restarted without its state)"
    return f"job {job_id} was replaced by job {job['job']}"
