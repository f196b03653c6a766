"""The contract between processes that is not a service's request/reply: the job plan, the worker environment, the
events.

- `JobPlan`: what a host needs to run a job's workers (command, environment,
  restart policy, snapshot settings). The registry builds it once from the
  job's spec and sends it in every `round` event and in its `job` reply; the
  agent, its restart policy and its snapshot keeper read it from there.
- `WorkerEnv`: the names of the variables an agent sets for its workers and
  libworker reads (beside torch's and Horovod's own, see
  slot_processes.rounds.round_environment).
- `Event`: the types of the notifier's events an agent acts on.

A name spelled here and imported everywhere turns a typo into an import error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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
    SNAPSHOT = "ELASTIC_SNAPSHOT"  # the path prefix of the host's snapshot slots
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
    """What every host needs to run a job's workers; it travels inside `round` events (with the round's fields)."""

    job: int
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    job_key: str = ""
    max_restarts: int | None = None
    restart_window: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_interval: float | None = None
    mode: str = "horovod"
    reset_limit: int | None = None
    preload: tuple[str, ...] = ()
    fork_server: bool = True
    hang_detection: bool = True
    hung_timeout: float | None = None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> JobPlan:
        """The plan in a `round` event or a job state (which may carry other fields); ValueError when it has none."""
        job, command = body.get("job"), body.get("command")
        if not isinstance(job, int) or not isinstance(command, list) or not command:
            raise ValueError("a job plan needs a job number and a command")
        env = body.get("env")
        return cls(
            job=job,
            command=[str(part) for part in command],
            env={str(k): str(v) for k, v in env.items()} if isinstance(env, dict) else {},
            cwd=body.get("cwd") if isinstance(body.get("cwd"), str) else None,
            job_key=str(body.get("job_key") or ""),
            max_restarts=body.get("max_restarts") if isinstance(body.get("max_restarts"), int) else None,
            restart_window=_number(body.get("restart_window")),
            checkpoint_dir=body.get("checkpoint_dir") if isinstance(body.get("checkpoint_dir"), str) else None,
            checkpoint_interval=_number(body.get("checkpoint_interval")),
            mode="torchrun" if body.get("mode") == "torchrun" else "horovod",
            reset_limit=body.get("reset_limit") if isinstance(body.get("reset_limit"), int) else None,
            preload=tuple(str(name) for name in body.get("preload") or () if isinstance(name, str))
            if isinstance(body.get("preload"), list)
            else (),
            fork_server=body.get("fork_server") is not False,
            hang_detection=body.get("hang_detection") is not False,
            hung_timeout=_number(body.get("hung_timeout")),
        )


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
