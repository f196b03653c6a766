"""What an elastic job asks of each node (slurm/resources.py): one task, and for a GPU job each GPU's share of the
node's CPUs and memory, read from sinfo, unless the user asked for CPUs or memory; said in one line when Slurm cannot
tell (tests/slurm/test_slurm_gpu_site.py runs it on a Slurm configured like a GPU site)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elastic_control_plane.slurm.resources import NodeShape, parse_node_shapes, resource_lines, share_per_gpu

SINFO = "64|512000|gpu:a100:8(S:0-1)\n32|256000|gpu:4\n16|64000|(null)\nnot a line\n"


def test_sinfo_lines_become_node_shapes_whatever_the_gres_spelling() -> None:
    assert parse_node_shapes(SINFO) == [NodeShape(64, 512000, 8), NodeShape(32, 256000, 4), NodeShape(16, 64000, 0)]


def test_each_gpu_gets_the_smallest_share_among_the_nodes_with_that_many_gpus() -> None:
    nodes = parse_node_shapes(SINFO)
    assert share_per_gpu(nodes, 8) == (8, 64000), "only the 8-GPU node has 8"
    assert share_per_gpu(nodes, 4) == (8, 64000), "a 4-GPU job may land on either: the smaller share"
    assert share_per_gpu(nodes, 16) is None


def test_the_users_own_cpu_or_memory_options_replace_ours() -> None:
    share = (8, 64000)
    assert resource_lines(8, [], share) == ["--ntasks-per-node=1", "--cpus-per-gpu=8", "--mem-per-gpu=64000M"]
    assert resource_lines(8, ["-c", "4"], share) == ["--ntasks-per-node=1", "--mem-per-gpu=64000M"]
    assert resource_lines(8, ["--mem=100G"], share) == ["--ntasks-per-node=1", "--cpus-per-gpu=8"]
    assert resource_lines(8, ["--exclusive"], share) == ["--ntasks-per-node=1"]
    assert resource_lines(None, [], share) == ["--ntasks-per-node=1"], "a CPU job asks one task per node only"


def test_a_gpu_job_where_slurm_cannot_tell_the_share_says_so_in_one_line_and_asks_the_defaults(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"  # a sinfo that cannot reach slurmctld
    bin_dir.mkdir()
    (bin_dir / "sinfo").write_text("#!/bin/sh\necho 'sinfo: error: Unable to contact slurm controller' >&2\nexit 1\n")
    (bin_dir / "sinfo").chmod(0o755)
    done = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "slurm", "-N", "2", "--gpus-per-node", "2"]
        + ["--dry-run", "--", "python", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines() == [
        "elasticctl slurm: cannot read the nodes' CPUs and memory (sinfo -h -N -o %c|%m|%G: sinfo: error: Unable to "
        "contact slurm controller): the job asks Slurm's defaults for CPUs and memory (one CPU per node where the "
        "site sets no DefCpuPerGPU); give --cpus-per-gpu and --mem-per-gpu"
    ]
    assert "#SBATCH --ntasks-per-node=1" in done.stdout and "--cpus-per-gpu" not in done.stdout
    given = subprocess.run(
        [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "slurm", "-N", "2", "--gpus-per-node", "2"]
        + ["--cpus-per-gpu=4", "--mem-per-gpu=8G", "--dry-run", "--", "python", "train.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        timeout=60,
    )
    assert given.returncode == 0 and given.stderr == "", "the user's own: nothing to read, nothing to say"
