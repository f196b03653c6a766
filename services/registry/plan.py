"""The `round` event: the one place that builds what the agents are told of each round of the job (its job plan,
bus.contract.JobPlan, with the round's own fields)."""

from __future__ import annotations

from typing import Any

from elastic_control_plane.bus.contract import JobPlan
from elastic_control_plane.services.registry.job import Job


def round_plan(job: Job, size: int) -> dict[str, Any]:
    """The payload of the `round` event for the job's current round, of `size` ranks. Its fields:

    - `round`: the round's number;
    - `hosts`: the round's hosts in rank order, each with the ids of the slots it uses (`[[host, [slot ids]]]`,
      bus.assignments.round_hosts; an agent computes its slots with `slots_of`);
    - `size`: the number of ranks;
    - `job`: the job's number;
    - `job_key`: the job's random key (a host's snapshot of another job is never restored);
    - `command`, `cwd`, `env`: what each worker runs, where, with which extra environment;
    - `max_restarts`, `restart_window`: the agent's restart policy for a crashing slot;
    - `checkpoint_dir`, `checkpoint_interval`: where and how often the host's snapshot is copied to disk (None: never);
    - `mode`: "horovod" (the workers join rounds through libworker) or "torchrun" (each slot's supervisor joins
      them and restarts the command with torchrun's environment at every round);
    - `reset_limit`: the job's reset limit (None: none), which torchrun mode gives its commands as
      TORCHELASTIC_MAX_RESTARTS;
    - `preload`, `fork_server`: what the hosts' fork servers import beyond torch, and whether the job's workers
      are forked from them at all (agent/fork_server.py);
    - `hang_detection`: whether the agents measure their workers' waits (agent/wait_watch.py) for the registry to
      find hung ranks and each rank's cost to the others (services/registry/waits.py);
    - `hung_timeout`: the upper bound of a hang, which bounds how long a watched worker's gloo collectives wait
      (libworker/world.py).
    """
    spec = job.spec
    assert spec is not None, "a round is planned only for a submitted job"
    plan = JobPlan(
        job=job.job_id,
        command=list(spec.command),
        env=dict(spec.env),
        cwd=spec.cwd,
        job_key=job.job_key,
        max_restarts=spec.max_restarts,
        restart_window=spec.restart_window,
        checkpoint_dir=spec.checkpoint_dir,
        checkpoint_interval=spec.checkpoint_interval,
        mode=spec.mode,
        reset_limit=spec.reset_limit,
        preload=tuple(spec.preload),
        fork_server=spec.fork_server,
        hang_detection=spec.hang_detection,
        hung_timeout=spec.hung_timeout,
    )
    return {**plan.to_wire(), "round": job.round, "hosts": job.round_hosts, "size": size}
