"""An elastic job on a Slurm configured like a GPU site (issue 59; testing/slurm/gpu-site.conf): tasks bound to the
CPUs they were given, cores and memory allocated, two GPUs per node as GRES. `sbatch -N 2 --gpus-per-node=2` alone
gets one CPU per node there, and every worker of a node ran on it; `elasticctl slurm` asks each GPU's share of the
node, so the workers of a node together may use every CPU the job holds on it, each sees the node's GPUs, and none
believes it is Slurm's task 0 of 1."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import pytest

from testing.slurm_cluster import REPO, SlurmCluster, running_slurm
from testing.slurm_cluster import slurm as run_slurm

GPU_SITE = REPO / "testing" / "slurm" / "gpu-site.conf"


@pytest.fixture(scope="module")
def slurm_running() -> Iterator[None]:
    with running_slurm(GPU_SITE):
        yield


def test_a_two_node_two_gpu_job_gives_its_workers_every_cpu_of_the_allocation_and_the_nodes_gpus(
    slurm: SlurmCluster,
) -> None:
    job = slurm.submit("-N", "2", "--gpus-per-node", "2", "--", "python", "counter.py", "--batches", "60",
                       "--step-delay", "0.05", "--log-dir", "log")  # fmt: skip
    assert slurm.wait_ended(job, 240) == "COMPLETED", slurm.output(job)[-3000:]
    fields = run_slurm("scontrol", "show", "job", job)
    assert "NumCPUs=4" in fields, fields  # 2 CPUs on each of 2 nodes: one per GPU, the whole node here
    entered = [e for e in slurm.events("log") if e["event"] == "enter"]
    by_host: dict[str, list[dict]] = defaultdict(list)
    for event in entered:
        by_host[event["host"]].append(event)
    assert len(by_host) == 2, entered
    for host, workers in by_host.items():
        assert {cpu for w in workers for cpu in w["cpus"]} == {0, 1}, (host, workers)  # the node's two CPUs, not one
        assert [w["gpus"] for w in workers] == ["0,1", "0,1"], (host, workers)  # the node's GPUs (libworker binds
        # each worker to the one of its local rank, as torchrun's workers see them)
        assert all(w["slurm_procid"] is None for w in workers), (host, workers)
