"""The batch script `elasticctl slurm` submits, rendered from its options (docs/slurm.md explains every line).

The script asks Slurm for what an elastic job needs (`--no-kill`: a lost node ends only its own step; `--requeue`
and `--open-mode=append`: a rerun continues the same job and output; `--signal=B:USR1@S`: the batch shell hears of
the limit or a preemption S seconds early), runs the driver (slurm/batch.py) in the background, forwards the
signals to it (only the batch shell gets them), and checks the driver's exit code (slurm/requeue.py): REQUEUE
requeues the job, excluding the hosts the job gave up on; any other code ends it. The options of sbatch's own that
the user gave go on sbatch's command line, unchanged, where they win over the script's lines.

A joining allocation (`--join JOB`) runs the driver alone: its agents enter JOB's control plane.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from elastic_control_plane.slurm.requeue import REQUEUE

DEFAULT_SIGNAL_BEFORE = 180  # seconds before the time limit the batch shell gets USR1 (Slurm may send it 60 s sooner)
# The least of it: the drain's 90 s to a commit written (slurm/batch.py DRAIN_TIMEOUT) and 10 s to stop the rest.
MIN_SIGNAL_BEFORE = 100
DEFAULT_MAX_REQUEUES = 20
DRIVER_MODULE = "elastic_control_plane.slurm.batch"


@dataclass(frozen=True)
class SlurmJob:
    """What the batch script is rendered from; paths absolute (the script runs on the batch host, not here)."""

    nodes: int
    command: list[str]
    state_dir: Path
    python: str
    run_flags: list[str] = field(default_factory=list)
    sbatch_options: list[str] = field(default_factory=list)
    gpus_per_node: int | None = None
    resources: list[str] = field(default_factory=list)  # slurm/resources.py: the tasks, CPUs and memory asked
    partition: str | None = None
    time: str | None = None
    control_hosts: int = 1
    control: str | None = None
    join: str | None = None
    exclude: str | None = None  # a joining allocation: the joined job's nodes, which already have agents
    signal_before: int = DEFAULT_SIGNAL_BEFORE
    max_requeues: int = DEFAULT_MAX_REQUEUES
    job_name: str = "elastic"
    output: str = "elastic-%j.out"

    def driver_argv(self) -> list[str]:
        """The driver's command line: its own options, `--`, then `elasticctl run`'s (a joining one has none)."""
        argv = [self.python, "-m", DRIVER_MODULE, "--state-dir", str(self.state_dir)]
        if self.gpus_per_node is not None:
            argv += ["--gpus-per-node", str(self.gpus_per_node)]
        if self.join is not None:
            return [*argv, "--join", self.join]
        if self.control is not None:
            argv += ["--control", self.control]
        else:
            argv += ["--control-hosts", str(self.control_hosts)]
        return [*argv, "--max-requeues", str(self.max_requeues), "--", *self.run_flags, "--", *self.command]

    def directives(self) -> list[str]:
        lines = [f"--job-name={self.job_name}", f"--nodes={self.nodes}"]
        lines += [f"--gpus-per-node={self.gpus_per_node}"] if self.gpus_per_node is not None else []
        lines += self.resources
        lines += [f"--partition={self.partition}"] if self.partition else []
        lines += [f"--time={self.time}"] if self.time else []
        if self.join is not None:
            lines += [f"--exclude={self.exclude}"] if self.exclude else []
            return [*lines, "--no-kill", f"--comment=elastic-join={self.join}", f"--output={self.output}"]
        return [
            *lines,
            "--no-kill",
            "--requeue",
            "--open-mode=append",
            f"--signal=B:USR1@{self.signal_before}",
            f"--output={self.output}",
        ]


def sbatch_argv(job: SlurmJob, script: Path) -> list[str]:
    """How the script is submitted: the user's sbatch options unchanged, then the script."""
    return ["sbatch", "--parsable", *job.sbatch_options, str(script)]


def render(job: SlurmJob) -> str:
    """The batch script, as text."""
    head = [
        "#!/bin/bash",
        "# Rendered by elasticctl slurm; docs/slurm.md explains every line.",
        *(f"#SBATCH {line}" for line in job.directives()),
    ]
    if job.sbatch_options:
        head += [
            "# Submitted with sbatch's own options, which win over the lines above:",
            f"#   sbatch {shlex.join(job.sbatch_options)} SCRIPT",
        ]
    driver = shlex.join(job.driver_argv())
    if job.join is not None:
        return "\n".join([*head, "set -u", f"exec {driver}", ""])
    state = shlex.quote(str(job.state_dir))
    body = [
        "set -u",
        f"{driver} &",
        "driver=$!",
        "trap 'kill -USR1 \"$driver\"' USR1  # the time limit or a preemption is near: checkpoint, drain, requeue",
        "trap 'kill -TERM \"$driver\"' TERM  # scancel, preemption, requeue: last commit to the checkpoint, then stop",
        'while kill -0 "$driver" 2>/dev/null; do wait "$driver"; done  # a trapped signal ends a wait early',
        'wait "$driver"; rc=$?',
        f'if [ "$rc" -eq {REQUEUE} ]; then  # checkpointed: run again, without the hosts the job gave up on',
        "  trap '' TERM  # the requeue SIGTERMs this script's step: not before the exclusion (scontrol inherits it)",
        '  scontrol requeue "$SLURM_JOB_ID" || exit 1',
        f'  exclude=$(cat {state}/"$SLURM_JOB_ID"/exclude 2>/dev/null || true)',
        '  [ -z "$exclude" ] || scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$exclude"',
        "fi",
        'exit "$rc"',
        "",
    ]
    return "\n".join([*head, *body])
