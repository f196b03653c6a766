"""Worker processes of one host: their environment, spawn (dying with the agent), signal, reap, and each one's record.

Everything the agent keeps of one worker lives on its `Worker` and goes with it when it is reaped: its process and
output, where its events go (`event_route`, once it subscribed), its wait watch (agent/wait_watch.py), a stack dump
under way and why it was killed as hung (agent/hung_workers.py). The keeper holds each worker in exactly one place:
its slot, or the standby pool (agent/keeper.py).

A worker is spawned here or forked by the host's fork server
(agent/fork_server.py); either way it is this process's child, and its
stdout and stderr are pipes the agent reads (agent/output.py).
A standby (local rank STANDBY until its agent admits it to a slot) is a
worker process like any other.
Each worker runs in its own session so a signal reaches its whole process
tree, and has PR_SET_PDEATHSIG set so it is killed if the agent dies, even by
SIGKILL: an agent never leaves orphans.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elastic_control_plane.agent import process_tree
from elastic_control_plane.agent.output import PrefixedPipe
from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.bus.lifetime import die_with_parent
from elastic_control_plane.job.assignments import SlotInfo
from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.slot_processes import wait_record
from elastic_control_plane.slot_processes.forking import WorkerProcess
from elastic_control_plane.slot_processes.rounds import round_environment

STANDBY = -1
# The agent's own settings that no worker inherits: its keys directory (a worker talks to its agent alone, over
# its owner-only ipc socket, and a training script, or what it imports, has no use for the control plane's keys).
AGENT_ONLY = frozenset({"ELASTIC_KEYS"})
# What srun sets for the agent's step, task 0 of 1 on its node: a worker that kept them would be rank 0 of a world of 1
# to whatever reads Slurm's (Lightning's SLURMEnvironment, submitit), against its real rank. The allocation's own
# (SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_CPUS_ON_NODE ...) stay.
AGENT_STEP_TASK = frozenset(
    {
        "SLURM_PROCID",
        "SLURM_LOCALID",
        "SLURM_GTIDS",
        "SLURM_TASK_PID",
        "SLURM_NTASKS",
        "SLURM_NPROCS",
        "SLURM_NTASKS_PER_NODE",
        "SLURM_TASKS_PER_NODE",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_STEP_TASKS_PER_NODE",
    }
)


def inheritable(environ: Mapping[str, str]) -> dict[str, str]:
    """The agent's environment as its workers and its fork server get it: without AGENT_ONLY and AGENT_STEP_TASK."""
    return {name: value for name, value in environ.items() if name not in AGENT_ONLY | AGENT_STEP_TASK}


@dataclass(frozen=True)
class WatchFiles:
    """A worker's wait record and stack file, created before it starts."""

    record: str
    stack: str

    def env(self) -> dict[str, str]:
        return {wait_record.RECORD_ENV: self.record, wait_record.STACK_ENV: self.stack}

    def remove(self) -> None:
        for path in (self.record, self.stack):
            Path(path).unlink(missing_ok=True)


@dataclass
class Watch:
    """A worker under wait watch: its files, its record, and what its progress last looked like."""

    files: WatchFiles
    reader: wait_record.RecordReader
    used: dict[process_tree.ProcessKey, process_tree.Used] | None = None  # the tree's usage at the last sample
    sampled_at: float = 0.0
    progressed_at: float = 0.0
    stopped_since: float | None = None  # first seen stopped inside the wait under way (None: running)
    state_sampled_at: float = 0.0
    reported: dict[str, tuple[float, float]] = field(default_factory=dict)  # quantity: (episode start, value sent)
    closed: bool = False

    def excuse(self, until: float) -> None:
        if not self.closed:
            self.reader.excuse(until)

    def close(self) -> None:
        """The worker exited: its files go."""
        if not self.closed:
            self.closed = True
            self.reader.close()
            self.files.remove()


@dataclass
class StackDump:
    """A stack the worker was asked for, appended to its stack file from `start`: shown (and, when `kills`, the
    worker killed) once the dump stops growing, or at `deadline`."""

    reason: str
    deadline: float
    kills: bool
    start: int = 0
    size: int = -1


@dataclass
class Worker:
    local_rank: int
    process: WorkerProcess
    forked: bool = False
    stop_requested: bool = False
    output: list[PrefixedPipe] = field(default_factory=list)
    script_ended: bool = False
    uncaught_exception: bool = False
    event_route: bytes | None = None  # where its events and the agent's heartbeats go, once it subscribed
    watch: Watch | None = None
    stack_dump: StackDump | None = None
    hang: dict[str, str] = field(default_factory=dict)  # killed as hung: why, and its stack (for its exit report)

    def died_after_its_script(self, code: int) -> bool:
        """Killed by a signal after it told us its script had ended without an exception: a crash in the
        interpreter's teardown, after the worker's work was done (not a crash during the job)."""
        return code < 0 and self.script_ended and not self.uncaught_exception

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def stack_file(self) -> str | None:
        """Where it writes its stack when asked (a worker of a job that finds hangs); None otherwise."""
        return None if self.watch is None or self.watch.closed else self.watch.files.stack

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass


@dataclass(frozen=True)
class HostSettings:
    """What every worker of this host is told about the host and its agent."""

    host: str
    agent_endpoint: str
    advertise_address: str
    share_gpus: bool
    timing_env: Mapping[str, str]


def worker_env(
    base: Mapping[str, str],
    plan: JobPlan,
    host: HostSettings,
    local_rank: int,
    slot: SlotInfo | None,
    snapshot_env: Mapping[str, str],
) -> dict[str, str]:
    """The environment of the worker of `local_rank` (STANDBY: a spare, with no local rank until admitted): the
    agent's own (`inheritable`), the job's, the host's, the snapshot's and, for a worker started into a known slot,
    its place in the round (in torchrun mode the slot's supervisor sets that for each round, and learns the reset
    limit)."""
    env = {
        **inheritable(base),
        **plan.spec.env,
        **host.timing_env,
        WorkerEnv.AGENT: host.agent_endpoint,
        WorkerEnv.AGENT_PID: str(os.getpid()),
        WorkerEnv.HOST: host.host,
        WorkerEnv.ADVERTISE_ADDR: host.advertise_address,
        WorkerEnv.GPU_SHARED: "1" if host.share_gpus else "0",
        WorkerEnv.JOB: str(plan.job),
        **snapshot_env,
    }
    env.setdefault("PYTHONUNBUFFERED", "1")
    if local_rank == STANDBY:
        env[WorkerEnv.STANDBY] = "1"
        for name in (WorkerEnv.LOCAL_RANK, "LOCAL_RANK"):
            env.pop(name, None)
    else:
        env.update({WorkerEnv.LOCAL_RANK: str(local_rank), "LOCAL_RANK": str(local_rank)})
    if plan.spec.mode == "torchrun":
        if plan.spec.reset_limit is not None:
            env[WorkerEnv.RESET_LIMIT] = str(plan.spec.reset_limit)
    elif slot is not None:
        env.update(round_environment(slot))
    return env


def worker_command(plan: JobPlan) -> list[str]:
    """What a worker process runs: the job's command, or in torchrun mode the slot's supervisor around it."""
    return (
        [sys.executable, "-m", "elastic_control_plane.slot_processes.torchrun_slot", "--", *plan.spec.command]
        if plan.spec.mode == "torchrun"
        else list(plan.spec.command)
    )


def spawn(command: list[str], env: dict[str, str], cwd: str | None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        command,
        env=env,
        cwd=cwd if cwd and os.path.isdir(cwd) else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=die_with_parent(),
    )


def reap(workers: dict[int, Worker]) -> list[tuple[Worker, int]]:
    """Remove and return the workers that have exited, with their exit codes (negative: killed by signal); their wait
    files go with them."""
    exited = []
    for key, worker in list(workers.items()):
        code = worker.process.poll()
        if code is not None:
            del workers[key]
            if worker.watch is not None:
                worker.watch.close()
            exited.append((worker, code))
    return exited
