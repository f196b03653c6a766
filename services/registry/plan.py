"""The job plan and the `round` event: the one place that builds what the agents are told of the job (its plan,
job.plan.JobPlan) and of each round (the plan with the round's own fields)."""

from __future__ import annotations

from typing import Any

from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.services.registry.job import Job


def job_plan(job: Job) -> JobPlan:
    """What every host needs to run the job's workers (job.plan.JobPlan), for a submitted job."""
    assert job.spec is not None, "a plan is made only for a submitted job"
    return JobPlan(job.job_id, job.job_key, job.spec)


def round_plan(job: Job, size: int) -> dict[str, Any]:
    """The payload of the `round` event for the job's current round, of `size` ranks. Its fields:

    - `job`, `job_key`, `spec`: the job plan (the job's number, its random key, so that a host's snapshot of another
      job is never restored, and its spec: what each worker runs, where, with which environment; the restart
      policy; where the host's snapshot is copied; the mode; the fork server's preloads; whether hangs are
      judged and the hung timeout; job/spec.py);
    - `round`: the round's number;
    - `hosts`: the round's hosts in rank order, each with the ids of the slots it uses (`[[host, [slot ids]]]`,
      job.assignments.round_hosts; an agent computes its slots with `slots_of`);
    - `size`: the number of ranks.
    """
    return {**job_plan(job).to_wire(), "round": job.round, "hosts": job.round_hosts, "size": size}
