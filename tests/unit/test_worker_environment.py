"""What a worker inherits of its agent's environment (agent/workers.py `inheritable`): not the agent's keys, and not
the task variables srun set for the agent's own step (task 0 of 1), which would make every worker rank 0 of a world of
1 to Lightning's and submitit's Slurm detection; the allocation's variables and everything else stay."""

from __future__ import annotations

from elastic_control_plane.agent.workers import inheritable

AGENT_STEP = {  # an agent's step on a node of a 2-node allocation, as srun sets it
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_NNODES": "2",
    "SLURM_CPUS_ON_NODE": "16",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "1",
    "SLURM_NPROCS": "1",
    "SLURM_STEP_NUM_TASKS": "1",
    "SLURM_TASKS_PER_NODE": "1",
    "SLURM_GTIDS": "0",
    "ELASTIC_KEYS": "/shared/job/agent-keys",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "PATH": "/usr/bin",
}


def test_a_worker_keeps_the_allocations_variables_and_loses_the_agents_task_and_keys() -> None:
    kept = inheritable(AGENT_STEP)
    assert kept == {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_NNODES": "2",
        "SLURM_CPUS_ON_NODE": "16",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "PATH": "/usr/bin",
    }


def test_outside_slurm_nothing_but_the_keys_goes() -> None:
    plain = {"PATH": "/usr/bin", "HOME": "/home/u", "RANK_HINT": "x"}
    assert inheritable({**plain, "ELASTIC_KEYS": "/k"}) == plain
