"""What an elastic job asks of each node besides its nodes and GPUs (the batch script's resource lines).

One task per node: the driver starts one agent step per node, and each agent its workers. A GPU job asks, unless the
user says otherwise, each GPU's share of the node's CPUs and memory (`--cpus-per-gpu`, `--mem-per-gpu`: the node's
CPUs and memory over its GPUs, read from `sinfo` at submission; the smallest share among the nodes that have that
many GPUs): a site that sets no `DefCpuPerGPU` otherwise gives the job one CPU per node, and every worker of the node
and its fork server share it. The agent's step then holds every CPU the job has on its node (srun's default). Any
CPU or memory option of the user's own (`-c`, `--cpus-per-gpu`, `--mem*`, `--exclusive`) replaces ours. A job
without GPUs asks one task per node and nothing more.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elastic_control_plane.slurm.sbatch_options import given

CPU_OPTIONS = ("-c", "--cpus-per-task", "--cpus-per-gpu", "--exclusive")
MEMORY_OPTIONS = ("--mem", "--mem-per-cpu", "--mem-per-gpu", "--exclusive")
GPU_COUNT = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")  # gpu:8, gpu:a100:8, gpu:a100:8(S:0-1)


@dataclass(frozen=True)
class NodeShape:
    """A node as `sinfo -h -N -o "%c|%m|%G"` prints it: CPUs, memory (MB) and GPUs."""

    cpus: int
    memory_mb: int
    gpus: int


def parse_node_shapes(text: str) -> list[NodeShape]:
    shapes = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 3 or not fields[0].isdigit():
            continue
        gpus = sum(int(count) for count in GPU_COUNT.findall(fields[2]))
        memory = int(fields[1]) if fields[1].isdigit() else 0
        shapes.append(NodeShape(int(fields[0]), memory, gpus))
    return shapes


def share_per_gpu(nodes: list[NodeShape], gpus_per_node: int) -> tuple[int, int] | None:
    """(CPUs, memory in MB) each GPU's share of a node, the smallest among the nodes with `gpus_per_node` GPUs or
    more; None when no node has that many."""
    fitting = [node for node in nodes if node.gpus >= gpus_per_node]
    if not fitting:
        return None
    cpus = min(max(1, node.cpus // node.gpus) for node in fitting)
    memory = min(node.memory_mb // node.gpus for node in fitting)
    return cpus, memory


def user_gave(sbatch: list[str], names: tuple[str, ...]) -> bool:
    return any(name in names for name, _ in given(sbatch))


def resource_lines(gpus_per_node: int | None, sbatch: list[str], share: tuple[int, int] | None) -> list[str]:
    """The batch script's resource lines: one task per node and, for a GPU job, each GPU's `share` of CPUs and memory
    where the user gave none of their own."""
    lines = ["--ntasks-per-node=1"]
    if gpus_per_node is None or share is None:
        return lines
    cpus, memory = share
    if not user_gave(sbatch, CPU_OPTIONS):
        lines.append(f"--cpus-per-gpu={cpus}")
    if memory > 0 and not user_gave(sbatch, MEMORY_OPTIONS):
        lines.append(f"--mem-per-gpu={memory}M")
    return lines
