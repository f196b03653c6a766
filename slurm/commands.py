"""Slurm's commands, run: one function per question asked of Slurm, each a SlurmError with one line when the
command is missing, fails or prints what cannot be read (parsing: slurm/hostlist.py)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess

from elastic_control_plane.slurm.hostlist import (
    SQUEUE_FIELDS,
    NodeState,
    RunningJob,
    SlurmOutputError,
    parse_node_states,
    parse_scontrol_fields,
    parse_squeue,
)
from elastic_control_plane.slurm.resources import NodeShape, parse_node_shapes

CONTROL_STEP = "elastic-control"  # the name of a control host's step (slurm/control_steps.py), told from the agents'
TIMEOUT = 10.0  # seconds a Slurm command may take (slurmctld busy) before it counts as failed


class SlurmError(Exception):
    """A Slurm command could not answer: the message is one line."""


def run(argv: list[str], timeout: float = TIMEOUT) -> str:
    """`argv`'s standard output; SlurmError when Slurm is not installed, or the command fails or hangs."""
    if shutil.which(argv[0]) is None:
        raise SlurmError(
            f"{argv[0]} is not installed: Slurm's client commands are needed (apt-get install slurm-client)"
        )
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)} did not answer in {timeout:g} s") from None
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise SlurmError(f"{' '.join(argv)}: {reason}")
    return done.stdout


def running_jobs(own: bool = False) -> list[RunningJob]:
    """The running jobs: every user's, or (`own`) this user's alone, a smaller answer for slurmctld to make."""
    user = ["-u", pwd.getpwuid(os.getuid()).pw_name] if own else []
    try:
        return parse_squeue(run(["squeue", "-h", "-t", "RUNNING", *user, "-O", SQUEUE_FIELDS]))
    except SlurmOutputError as exc:
        raise SlurmError(str(exc)) from None


def node_states() -> dict[str, NodeState]:
    try:
        return parse_node_states(run(["sinfo", "-h", "-N", "-o", "%N|%T"]))
    except SlurmOutputError as exc:
        raise SlurmError(str(exc)) from None


def node_shapes(partition: str | None) -> list[NodeShape]:
    """Each node's CPUs, memory and GPUs (of `partition`, else of every partition)."""
    return parse_node_shapes(run(["sinfo", "-h", "-N", *(["-p", partition] if partition else []), "-o", "%c|%m|%G"]))


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job JOB`'s fields; SlurmError naming the job when Slurm does not know it."""
    try:
        text = run(["scontrol", "show", "job", job_id])
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            raise SlurmError(f"Slurm has no job {job_id}") from None
        raise
    return parse_scontrol_fields(text)


def node_address(node: str) -> str:
    """Where `node`'s services can be reached: its NodeAddr (the address Slurm itself uses)."""
    address = parse_scontrol_fields(run(["scontrol", "show", "node", node])).get("NodeAddr")
    if not address:
        raise SlurmError(f"scontrol show node {node} names no NodeAddr")
    return address


def agent_steps(job_id: str) -> dict[str, str]:
    """{node: step id} of the job's steps that run on one node (the agents'), the batch step and the control hosts'
    steps (CONTROL_STEP) left out."""
    steps = {}
    for line in run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%N|%j"]).splitlines():
        step, _, rest = line.strip().partition("|")
        nodes, _, name = rest.partition("|")
        one_node = "," not in nodes and "[" not in nodes
        if step and not step.endswith((".batch", ".extern")) and one_node and name != CONTROL_STEP:
            steps[nodes] = step
    return steps


def signal_step(step: str, signal_name: str) -> None:
    """Send every process of the step a signal, without ending the step (scancel --signal). Slurm 22.05's scancel
    delivers it, then says "Kill job error on job step id N: Invalid job id specified" and exits 1: that is no
    failure."""
    try:
        run(["scancel", f"--signal={signal_name}", step])
    except SlurmError as exc:
        if "Invalid job id specified" not in str(exc):
            raise
