"""What the driver reads of its allocation and its job: the nodes (of every component of a heterogeneous job) and the
newest durable checkpoint (the hosts the job gave up on: slurm/exclusions.py). Pure but for reading the checkpoint
directory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from elastic_control_plane.slurm.hostlist import SlurmOutputError, expand_hostlist
from elastic_control_plane.snapshot.durable import checkpoint_files


def allocation_groups(env: Mapping[str, str]) -> list[tuple[int | None, str]]:
    """(het group, node) for each node of the allocation, in Slurm's order: of a heterogeneous job every component's
    (SLURM_JOB_NODELIST_HET_GROUP_n, n < SLURM_HET_SIZE), the group given so `srun --het-group` can reach it; else
    SLURM_JOB_NODELIST's, group None. SlurmOutputError when a list is missing or cannot be read."""
    if env.get("SLURM_HET_SIZE"):
        groups: list[tuple[int | None, str]] = []
        for group in range(int(env["SLURM_HET_SIZE"])):
            variable = f"SLURM_JOB_NODELIST_HET_GROUP_{group}"
            if variable not in env:
                raise SlurmOutputError(f"{variable} is unset in a heterogeneous job of {env['SLURM_HET_SIZE']}")
            groups += [(group, node) for node in expand_hostlist(env[variable]) if all(node != n for _, n in groups)]
        return groups
    if not env.get("SLURM_JOB_NODELIST"):
        raise SlurmOutputError("SLURM_JOB_NODELIST is unset: not in a Slurm allocation")
    return [(None, node) for node in expand_hostlist(env["SLURM_JOB_NODELIST"])]


def newest_commit(checkpoint_dir: Path) -> int:
    """The commit of the newest checkpoint under `checkpoint_dir` (any host's), 0 when there is none."""
    files = checkpoint_files(checkpoint_dir)
    return int(files[0].stem.split("-")[1]) if files else 0
