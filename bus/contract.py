"""The contract between processes that is not a service's request/reply: the worker environment and the events (the
job's plan, which `round` events carry, is job/plan.py).

- `WorkerEnv`: the names of the variables an agent sets for its workers and
  libworker reads (beside torch's and Horovod's own, see
  slot_processes.rounds.round_environment).
- `Event`: the types of the notifier's events an agent acts on;
  `PUBLISH_KEY`, the field of an event that names its publisher's key (the
  notifier publishes a key once: services/notifier/service.py).

A name spelled here and imported everywhere turns a typo into an import error.
"""

from __future__ import annotations


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


PUBLISH_KEY = "publish_key"  # an event's key, given by its publisher's outbox: the notifier publishes a key once
