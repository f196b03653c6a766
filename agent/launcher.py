"""Launcher: how one worker process of this host starts: forked from the host's fork server, else spawned.

The launcher owns the host's snapshot of the job's committed state (agent/snapshots.py) from start to end: a new
job's processes start with fresh buffers, flushed to disk every heartbeat, removed when the job ends or the agent
stops.
Every process is forked from the host's fork server where it serves the job
(agent/fork_server.py), else spawned (agent/workers.py), and the job's output
says so once with the reason (`[host] workers start as fresh interpreters
...: REASON`). While the fork server imports, the keeper holds starts back
until it is ready (`holds_back`). Each process's stdout and stderr are
forwarded, line by line, with a `[host:slot]` prefix (agent/output.py). A worker of a job that finds hangs
starts with its wait record and stack file (agent/wait_watch.py).
Which processes the host should have is agent/keeper.py's business.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection
from typing import Any

from elastic_control_plane.agent.fork_choice import Key, forked_argv, key_of, own_key
from elastic_control_plane.agent.fork_server import SPAWN_COST, ForkServer
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.output import PrefixedPipe
from elastic_control_plane.agent.snapshots import SnapshotKeeper
from elastic_control_plane.agent.wait_watch import WaitWatch
from elastic_control_plane.agent.workers import STANDBY, HostSettings, Worker, spawn, worker_command, worker_env
from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.bus.service import Service
from elastic_control_plane.job.assignments import SlotInfo
from elastic_control_plane.job.plan import JobPlan


class Launcher:
    def __init__(
        self,
        settings: HostSettings,
        fork_server: ForkServer,
        watch: WaitWatch,
        service: Service,
        snapshot_flush_every: float,
        log: Any,
    ) -> None:
        self.settings, self.fork_server, self.watch, self.service, self.log = settings, fork_server, watch, service, log
        self.snapshots = SnapshotKeeper(settings.host, log)
        self._pipes: set[PrefixedPipe] = set()  # the workers' output streams still open
        service.every(INTERVALS.partial_line_wait, self._flush_stale_output)
        service.every(snapshot_flush_every, self.snapshots.tick)
        self.in_job = False
        self.fork_key: Key | None = None
        self.fork_why_not = ""
        self.said_spawning = False

    def adopt_job(self, plan: JobPlan, new_job: bool) -> None:
        """What the job's processes start with: a new job's fresh snapshot buffers, and its zygote running or starting
        (a new job may say again that it spawns)."""
        if new_job:
            self.snapshots.start_job(plan)
            self.fork_server.new_job()
            self.said_spawning = False
        self.fork_key, self.fork_why_not = key_of(plan, os.environ)
        self.fork_server.prepare(self.fork_key)
        self.in_job = True
        self.say_if_spawning()

    def end_job(self, flush: bool = False) -> None:
        """The job finished: its snapshot buffers go (`flush`: once their newest commit is on disk), and the fork
        server readies for the next."""
        self.in_job = False
        self.snapshots.end_job(flush)
        if self.fork_server.zygote is None:
            self.fork_server.prepare(own_key())  # the job's could not serve: ready the agent's own for the next

    def holds_back(self) -> bool:
        """The job's zygote still imports: process starts wait for it (a fresh interpreter would import torch beside
        it)."""
        return self.fork_server.starting(self.fork_key)

    def start(self, local_rank: int, plan: JobPlan, slot: SlotInfo | None, may_spawn: bool) -> Worker | None:
        """The process of `local_rank` (STANDBY: a spare that waits in `init()` for a slot), forked or spawned, its
        output followed; None when it could only be spawned and `may_spawn` is False. OSError: it could not start."""
        env = worker_env(os.environ, plan, self.settings, local_rank, slot, self.snapshots.worker_env())
        files = self.watch.new_files() if plan.spec.hang_detection and plan.spec.mode == "horovod" else None
        if files is not None:
            env.update(files.env())
            env[WorkerEnv.HUNG_TIMEOUT] = f"{plan.spec.hung_timeout:g}"
        worker = None
        try:
            worker = self._process(local_rank, plan, env, may_spawn)
        finally:
            if worker is None and files is not None:
                files.remove()
        if worker is None:
            return None
        if files is not None:
            self.watch.watch(worker, files)
        for stream, sink in ((worker.process.stdout, sys.stdout.buffer), (worker.process.stderr, sys.stderr.buffer)):
            assert stream is not None
            pipe = PrefixedPipe(os.dup(stream.fileno()), self._output_prefix(worker), sink)
            worker.output.append(pipe)
            self._follow_output(pipe)
            stream.close()
        if local_rank == STANDBY:
            self.log.info("standby_started", pid=worker.pid, forked=worker.forked)
        else:
            self.log.info(
                "worker_started",
                local_rank=local_rank,
                rank=None if slot is None else slot.rank,
                pid=worker.pid,
                warming=slot is None,
                forked=worker.forked,
            )
        return worker

    def _process(self, local_rank: int, plan: JobPlan, env: dict[str, str], may_spawn: bool) -> Worker | None:
        """Fork the process from the fork server, else spawn it (None when it could only be spawned and `may_spawn`
        is False)."""
        argv = forked_argv(plan)
        forked = (
            None if argv is None else self.fork_server.fork(self.fork_key, [plan.spec.command[0], *argv], env, plan.cwd)
        )
        if forked is None:
            self.say_if_spawning()
            if not may_spawn:
                return None
        return Worker(local_rank, forked or spawn(worker_command(plan), env, plan.cwd), forked=forked is not None)

    def relabel(self, worker: Worker) -> None:
        """A standby admitted to a slot: its output is prefixed with the slot from now on."""
        for pipe in worker.output:
            pipe.prefix = self._output_prefix(worker).encode()

    def availability(self) -> dict[str, str]:
        """The host's fork server as `elasticctl status` shows it: for the job's workers, or between jobs for the
        zygote the agent keeps (the last job's, else its own interpreter's)."""
        if self.in_job:
            return self.fork_server.availability(self.fork_key, self.fork_why_not)
        zygote = self.fork_server.zygote
        return self.fork_server.availability(own_key() if zygote is None else zygote.key, "")

    def say_if_spawning(self) -> None:
        """Once per job: the job's output says this host spawns its workers, why, and what that costs."""
        if not self.in_job or self.said_spawning:
            return
        availability = self.fork_server.availability(self.fork_key, self.fork_why_not)
        if availability["state"] in ("unavailable", "off"):
            self.said_spawning = True
            sys.stdout.write(f"[{self.settings.host}] {SPAWN_COST}: {availability['reason']}\n")
            sys.stdout.flush()

    def children_exited(self) -> Collection[int]:
        """After SIGCHLD: a zygote that exited is started again or given up on (and the job's output says so where the
        host now spawns); the pids of the fork server, which are no orphans."""
        self.fork_server.check()
        self.say_if_spawning()
        return self.fork_server.pids()

    def close(self) -> None:
        self.fork_server.close()
        self.snapshots.close()

    def _output_prefix(self, worker: Worker) -> str:
        return f"[{self.settings.host}:{'standby' if worker.local_rank == STANDBY else worker.local_rank}] "

    def _follow_output(self, pipe: PrefixedPipe) -> None:
        def on_readable() -> None:
            if not pipe.pump():
                self.service.unwatch(pipe.fd)
                self._pipes.discard(pipe)

        self._pipes.add(pipe)
        self.service.watch(pipe.fd, on_readable)

    def _flush_stale_output(self) -> None:
        """A partial line that waited a second for its end is written as it is (agent/output.py)."""
        for pipe in self._pipes:
            pipe.flush_stale()
