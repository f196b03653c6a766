"""The contract between processes that is not a service's request/reply: the job plan, the worker environment, the
events.

- `JobPlan`: what a host needs to run a job's workers: the job's number and
  key and its spec, whole (command, environment, restart policy, snapshot
  settings). The registry builds it in one place (services/registry/plan.py)
  and sends it in every `round` event and in its `job` reply; the agent, its
  restart policy and its snapshot keeper read it from there.
- `WorkerEnv`: the names of the variables an agent sets for its workers and
  libworker reads (beside torch's and Horovod's own, see
  slot_processes.rounds.round_environment).
- `Event`: the types of the notifier's events an agent acts on.

A name spelled here and imported everywhere turns a typo into an import error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_control_plane.bus.jobspec import JobSpec


class WorkerEnv:
    """Variables of a worker's environment set by its agent."""

    AGENT = "ELASTIC_AGENT"  # the agent's ipc endpoint: rendezvous, store, events, standby admission
    AGENT_PID = "ELASTIC_AGENT_PID"  # the agent's pid: a worker wrapped in a shell finds the process the agent started
    HOST = "ELASTIC_HOST"  # the host's name as the job knows it
    ADVERTISE_ADDR = "ELASTIC_ADVERTISE_ADDR"  # the address peers reach this host's process groups at
    GPU_SHARED = "ELASTIC_GPU_SHARED"  # "1": every worker of the host sees every GPU (no per-slot pinning)
    JOB = "ELASTIC_JOB"  # the job's number
    LOCAL_RANK = "ELASTIC_LOCAL_RANK"  # the slot's id on the host (absent for a standby until admitted)
    STANDBY = "ELASTIC_STANDBY"  # "1": a spare that waits in init() for a slot
    SNAPSHOT = "ELASTIC_SNAPSHOT"  # the path prefix of the host's snapshot buffers (two files)
    JOB_KEY = "ELASTIC_JOB_KEY"  # the key the host's snapshot belongs to (a snapshot of another job is refused)
    CHECKPOINT_DIR = "ELASTIC_CHECKPOINT_DIR"  # where durable copies of the snapshot go (the job's --checkpoint-dir)
    RESET_LIMIT = (
        "ELASTIC_RESET_LIMIT"  # torchrun mode: the job's reset limit (TORCHELASTIC_MAX_RESTARTS); absent: none
    )
    HUNG_TIMEOUT = "ELASTIC_HUNG_TIMEOUT"  # the job's --hung-timeout, for a worker whose waits its agent watches
    SNAPSHOT_WRITER = (
        "ELASTIC_SNAPSHOT_WRITER"  # torchrun mode: "1" when this round's command writes the host's snapshot
    )


class Event:
    """Notifier events an agent acts on (published by the registry and discovery)."""

    ROUND = "round"  # a new round: its hosts and slots, with the job plan
    HOSTS_UPDATED = "hosts_updated"  # the available hosts changed (relayed to workers)
    ABORT = "abort"  # the round's collectives must stop (relayed to workers)
    WORKER_SUSPECTED = "worker_suspected"  # the others waited the calibrated limit for a worker with no progress:
    # its agent prints its stack and lets it run (it is killed at the hang limit if it still makes none)
    KILL_WORKER = "kill_worker"  # the registry found a worker hung: its agent dumps its stack and kills it
    WORKER_HUNG = "worker_hung"  # a hung worker was killed: its host, rank, why, and its stack
    STRAGGLER = "straggler"  # one rank has cost the others more than a set share of their time, for a while
    JOB_FINISHED = "job_finished"  # the job ended: stop every worker


@dataclass(frozen=True)
class JobPlan:
    """What every host needs to run a job's workers: the job's number, its key and its spec, whole. It travels
    inside `round` events (with the round's own fields) and the registry's `job` reply; a host parses the spec with
    the rules the registry applied (bus.jobspec)."""

    job: int
    job_key: str
    spec: JobSpec

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
