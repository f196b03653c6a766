"""JobPlan: what a host needs to run a job's workers: the job's number and key and its spec, whole (command,
environment, restart policy, snapshot settings). The registry builds it in one place (services/registry/plan.py) and
sends it in every `round` event and in its `job` reply; the agent, its restart policy and its snapshot keeper read it
from there, parsed by the spec's own rules (job/spec.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_control_plane.job.spec import JobSpec


@dataclass(frozen=True)
class JobPlan:
    """What every host needs to run a job's workers: the job's number, its key and its spec, whole. It travels
    inside `round` events (with the round's own fields) and the registry's `job` reply; a host parses the spec with
    the rules the registry applied (job.spec)."""

    job: int
    job_key: str
    spec: JobSpec

    @property
    def cwd(self) -> str | None:
        """Where the workers run: the directory the job was submitted from, None for the agent's own."""
        return self.spec.cwd or None

    def to_wire(self) -> dict[str, Any]:
        return {"job": self.job, "job_key": self.job_key, "spec": self.spec.to_dict()}

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> JobPlan:
        """The plan in a `round` event or a `job` reply (which carry other fields too); ValueError (a SpecError
        for the spec) when it has none or breaks a rule."""
        job, job_key = body.get("job"), body.get("job_key")
        if not isinstance(job, int) or isinstance(job, bool) or not isinstance(job_key, str):
            raise ValueError("a job plan needs a job number and a job key")
        return cls(job, job_key, JobSpec.parse(body.get("spec")))
