"""Submit a job and follow it to its end: a progress line per change, the job's exit code at the end."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import click

from elasticctl.control import CommandError, ControlPlane

POLL_INTERVAL = 0.25


def progress_line(job: dict[str, Any]) -> str:
    return f"[elasticctl] job {job['job']} {job['state']}: round {job['round']}, world size {job['size']}, resets {job['resets']}"


def submit_and_follow(plane: ControlPlane, spec: dict[str, Any]) -> int:
    spec = {**spec, "cwd": spec.get("cwd") or os.getcwd()}
    job_id = plane.call("registry", "submit", {"spec": spec})["job"]
    click.echo(f"[elasticctl] job {job_id} submitted: {' '.join(spec['command'])}", err=True)
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
    try:
        last = ""
        while True:
            if interrupted:
                plane.call("registry", "cancel", {"reason": "cancelled by elasticctl (interrupted)"})
                interrupted.clear()
            job = plane.call("registry", "job")
            if job["job"] != job_id:
                raise CommandError(f"job {job_id} was replaced by job {job['job']}")
            if job["state"] in ("succeeded", "failed"):
                click.echo(f"[elasticctl] job {job_id} {job['state']} after {job['resets']} reset(s): {job['reason']} (exit code {job['exit_code']})", err=True)
                return int(job["exit_code"] or 0)
            line = progress_line(job)
            if line != last:
                click.echo(line, err=True)
                last = line
            time.sleep(POLL_INTERVAL)
    finally:
        signal.signal(signal.SIGINT, previous)
