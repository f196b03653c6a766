"""The driver the batch script runs inside the allocation (`python -m elastic_control_plane.slurm.batch`).

It starts the control plane on the batch host (on the default ports, or the next five free there: another job's
control plane may hold them), unless `--control` names one outside the allocation or `--control-hosts N` replicates
it on the allocation's first N nodes (slurm/control_steps.py), one agent per node of the allocation as its own step
(`srun -N1 -n1 -w NODE --no-kill --kill-on-bad-exit=0 --overlap`: a lost node ends only its own step), and submits
the job with `elasticctl run --attach slurm-JOB` (a control plane that outlived a requeue follows the job it has),
then waits:

- the job ends: the agents and services are stopped; exit 0 when it finished, else what slurm/requeue.py decides;
- SIGUSR1 (the time limit or a preemption is near, or `scancel --batch --signal=USR1`): every agent step is sent
  SIGTERM through Slurm (`scancel --signal=TERM JOB.STEP`, which reaches every process of the step): the workers
  stop, their last commit safe in the host's snapshot, and the agent, draining, writes that commit to
  --checkpoint-dir once they are gone, then exits; then the hosts the job blacklisted (gave up on) are written to
  STATE/JOB/exclude, with why to exclude.json (slurm/exclusions.py), and the driver exits REQUEUE: the batch script
  requeues the job without them, which resumes from the checkpoint (a new job on the same --checkpoint-dir resumes
  from its newest checkpoint); the rerun's discovery is given exclude.json, and `elasticctl status` shows it;
- SIGTERM (a user's scancel, or a preemption with Slurm's defaults: `PreemptMode=REQUEUE` or `CANCEL` without
  `send_user_signal`): the agents drain as for USR1, their last commit written to the checkpoint within
  TERM_DRAIN_TIMEOUT (inside Slurm's KillWait), then everything stops; no requeue of our own (a scancel ends the job,
  Slurm requeues a preempted one itself, and its rerun resumes from that checkpoint).

Per allocation, STATE/JOB/ (0700, on the shared file system) holds the job's CURVE keys (made by the first run,
kept by its reruns and by allocations that join it; the agents are given `agent-keys/`, their role's share),
`control` (the control plane's address) and the logs of the services (with --control-hosts, also its etcd
certificates and data while a run lasts). `--join JOB` starts only
agents, which enter JOB's control plane, and runs until this allocation ends.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_control_plane.bus.config import DEFAULT_PORTS, Endpoints, control_address
from elastic_control_plane.bus.roles import AGENT
from elastic_control_plane.bus.sockets import generate_keys, role_keys
from elastic_control_plane.elasticctl.control import CommandError, ControlPlane
from elastic_control_plane.elasticctl.local_processes import (
    SERVICES,
    Processes,
    StartFailed,
    registered,
    service_argv,
)
from elastic_control_plane.slurm import commands, exclusions
from elastic_control_plane.slurm.allocation import allocation_groups, newest_commit
from elastic_control_plane.slurm.control_steps import ControlSteps
from elastic_control_plane.slurm.ports import PORT_STEP, free_port_block
from elastic_control_plane.slurm.requeue import SIGNAL_EXIT, decide

START_TIMEOUT = 60.0  # seconds for the services to answer
DRAIN_TIMEOUT = 90.0  # seconds the agents may take to reach a commit and write it after USR1
# After SIGTERM (a user's scancel, or a preemption with Slurm's defaults): the agents' last commit written within
# Slurm's KillWait (30 s by default), before its SIGKILL.
TERM_DRAIN_TIMEOUT = 20.0
AGENTS_TIMEOUT = 30.0  # seconds the first round waits for every node's agent
AGENTS_STOP = 10.0  # seconds the agents have to leave once the job has ended
# Ports taken by another job's control plane between the look and the bind: a later block, 0-2 blocks further at
# random, so that two drivers starting together on one address stop choosing the same block (each lost a service's
# port to the other, three times over, in a test run).
START_ATTEMPTS = 5
RETRY_SKIP_BLOCKS = 3
FOLLOWER_STOP = 10.0  # seconds `elasticctl run` and the services have to exit after SIGTERM, before SIGKILL


def say(line: str) -> None:
    print(f"[elastic slurm] {line}", file=sys.stderr, flush=True)


class Driver:
    def __init__(self, args: argparse.Namespace, run_args: list[str]) -> None:
        self.args, self.run_args = args, run_args
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
        home = args.join or self.job_id
        self.job_dir = args.state_dir / home
        self.keys = self.job_dir / "keys"
        self.agent_keys = self.job_dir / "agent-keys"  # the agents' share of them (bus.sockets.role_keys)
        self.processes = Processes()
        self.received: list[int] = []
        self.checkpoint_dir = Path(self._run_option("--checkpoint-dir") or self.job_dir / "checkpoints")
        self.control_steps: ControlSteps | None = None
        self.service_state_dirs: list[str] = []  # node-local, one per start; removed when the driver ends

    def _run_option(self, name: str) -> str | None:
        flags = self.run_args[: self.run_args.index("--")] if "--" in self.run_args else self.run_args
        for i, arg in enumerate(flags):
            if arg == name and i + 1 < len(flags):
                return flags[i + 1]
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
        return None

    # -- the control plane ---------------------------------------------------------------------------
    def prepare_keys(self) -> None:
        self.job_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.job_dir, 0o700)
        if not (self.keys / "server.key").exists():
            self.keys.mkdir(mode=0o700, exist_ok=True)
            generate_keys(self.keys)

    def services_env(self, excluded: list[dict[str, Any]]) -> dict[str, str]:
        """The environment of the services (of every control host's replicas): the job's keys, its Slurm job (whose
        node states discovery reads) and the hosts earlier runs gave up on."""
        return {
            **os.environ,
            "ELASTIC_KEYS": str(self.keys),
            "ELASTIC_SLURM_JOB": self.job_id,
            **({"ELASTIC_SLURM_EXCLUDED": json.dumps(excluded)} if excluded else {}),
        }

    def start_control(self) -> str:
        """The control plane in the allocation: on the batch host, or replicated on the first --control-hosts nodes
        (slurm/control_steps.py)."""
        if self.args.control_hosts == 1:
            return self.start_control_plane()
        self.control_steps = ControlSteps(
            self.job_dir, self.keys, self.args.control_hosts, self.processes, self.services_env(self.excluded())
        )
        return self.control_steps.start()

    def start_control_plane(self) -> str:
        """The services on this (the batch) host, on the first block of five ports free there (another job's control
        plane may hold the default ones); their address (`HOST` or `HOST:PORT`), written to STATE/JOB/control."""
        address = commands.node_address(os.environ["SLURMD_NODENAME"])
        logs = self.job_dir / "logs"
        logs.mkdir(exist_ok=True)
        excluded = self.excluded()
        base = 0
        for attempt in range(1, START_ATTEMPTS + 1):
            skip = PORT_STEP * random.randrange(RETRY_SKIP_BLOCKS) if base else 0
            base = free_port_block(address, after=base + skip)
            endpoints = Endpoints.on_hosts([(address, base)])
            self.service_state_dirs.append(tempfile.mkdtemp(prefix="elastic-slurm-state-"))
            env = {
                **self.services_env(excluded),
                **endpoints.as_env(),
                "ELASTIC_STATE_DIR": self.service_state_dirs[-1],
            }
            for service in SERVICES:
                self.processes.start(service, service_argv(service), env, logs / f"{service}-{self.restarts}.log")
            plane = ControlPlane(endpoints, self.keys, timeout=0.5)
            try:
                for service in SERVICES:
                    self.processes.wait_until(
                        lambda s=service: plane.call(s, "ping"), START_TIMEOUT, f"{service} to answer", SERVICES
                    )
                break
            except StartFailed as exc:  # most likely a port taken between the look and the bind: the next block
                if attempt == START_ATTEMPTS:
                    raise
                last = base + len(DEFAULT_PORTS) - 1
                say(f"the control plane did not start on ports {base}-{last} ({exc}): trying the next ports")
                for service in SERVICES:
                    self.processes.stop(service, signal.SIGKILL)
            finally:
                plane.close()
        control = control_address(address, base)
        (self.job_dir / "control").write_text(control + "\n")
        return control

    # -- agents --------------------------------------------------------------------------------------
    def start_agents(self, control: str, skip: frozenset[str] = frozenset()) -> None:
        """An agent step on each node of the allocation but `skip` (a joined job's nodes: their agents run)."""
        role_keys(self.keys, AGENT, self.agent_keys)
        env = {**os.environ, "ELASTIC_KEYS": str(self.agent_keys), "ELASTIC_CONTROL": control}
        env.setdefault("ELASTIC_LOG_LEVEL", "WARNING")  # the job's output: the workers' lines and what went wrong
        env.pop("ELASTIC_SLURM_JOB", None)
        slots = ["--slots", str(self.args.gpus_per_node)] if self.args.gpus_per_node else []
        gpus = [f"--gpus-per-node={self.args.gpus_per_node}"] if self.args.gpus_per_node else []
        nodes = [(group, node) for group, node in allocation_groups(os.environ) if node not in skip]
        for group, node in nodes:
            het = [f"--het-group={group}"] if group is not None else []
            step = ["srun", *het, "-N1", "-n1", "-w", node, "--overlap", "--no-kill", "--kill-on-bad-exit=0", *gpus]
            # The agent is named after the node as Slurm knows it (every node may report the same hostname).
            agent = ["sh", "-c", 'exec "$0" -m elastic_control_plane.agent.main --host "$SLURMD_NODENAME" "$@"']
            self.processes.start(f"agent {node}", [*step, *agent, sys.executable, *slots], env, None)
        say(f"agents started on {', '.join(node for _, node in nodes)}")

    def wait_for_agents(self, control: str) -> None:
        """Until every node's agent has registered or its step has ended (a node lost while the job starts), for
        AGENTS_TIMEOUT at most, so that the job's first round has them all instead of a reset when the last arrive."""
        steps = {
            name.removeprefix("agent "): p for name, p in self.processes.running.items() if name.startswith("agent")
        }
        plane = ControlPlane(Endpoints.from_env(control), self.keys, timeout=0.5)

        def all_up() -> bool:
            hosts = plane.call("discovery", "hosts")
            return all(registered(hosts, node) or step.poll() is not None for node, step in steps.items())

        try:
            self.processes.wait_until(
                all_up,
                AGENTS_TIMEOUT,
                "every agent to register",
                (),
            )
        except StartFailed as exc:
            say(f"{exc}: the job starts with the agents up")
        finally:
            plane.close()

    def drain_agents(self, timeout: float) -> None:
        """SIGTERM to every agent step through Slurm (its workers stop, it checkpoints their last commit and exits);
        wait `timeout` seconds at most for the steps to end."""
        try:
            steps = commands.agent_steps(self.job_id)
        except commands.SlurmError as exc:
            say(f"cannot list the agents' steps ({exc}); stopping them")
            steps = {}
        for node, step in steps.items():
            try:
                commands.signal_step(step, "TERM")
            except commands.SlurmError as exc:
                say(f"cannot signal the agent on {node}: {exc}")
        deadline = time.monotonic() + timeout
        for name, process in list(self.processes.running.items()):
            if name.startswith("agent"):
                try:
                    process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # stop_all ends it
                    say(f"{name} did not drain in {timeout:g} s")

    # -- the run -------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, _: Any) -> None:
        self.received.append(signum)

    def follow(self, control: str) -> int | None:
        """Submit (or attach to) the job and wait: its exit code, or None when a signal came first."""
        argv = [sys.executable, "-m", "elastic_control_plane.elasticctl.main", "run", "--control", control]
        argv += ["--keys", str(self.keys), "--attach", f"slurm-{self.job_id}"]
        if self._run_option("--checkpoint-dir") is None:
            argv += ["--checkpoint-dir", str(self.checkpoint_dir)]
        follower = self.processes.start("follower", [*argv, *self.run_args], dict(os.environ), None)
        while not self.received:
            if follower.poll() is not None:
                return follower.returncode
            time.sleep(0.05)
        return None

    def main(self) -> int:
        try:
            return self.run()
        finally:
            if self.control_steps is not None:
                self.control_steps.remove()
            for state_dir in self.service_state_dirs:
                shutil.rmtree(state_dir, ignore_errors=True)

    def run(self) -> int:
        signal.signal(signal.SIGUSR1, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        commit_before = newest_commit(self.checkpoint_dir)
        self.prepare_keys()
        say(f"job {self.job_id}, run {self.restarts}; checkpoints in {self.checkpoint_dir} (commit {commit_before})")
        try:
            control = self.args.control or self.start_control()
            say(f"control plane at {control}: elasticctl status --control {control} --keys {self.keys}")
            self.start_agents(control)
            self.wait_for_agents(control)
            job_exit = self.follow(control)
        except (CommandError, StartFailed, commands.SlurmError, FileNotFoundError) as exc:
            say(f"cannot start: {exc}")
            self.processes.stop_all(grace=5.0)
            return 2 if isinstance(exc, FileNotFoundError) else 1
        if self.received and self.received[0] == signal.SIGTERM:
            # Not requeued by us: a user's scancel ends the job, and Slurm requeues a preempted one itself.
            say(f"TERM: cancelled or preempted: the last commit to the checkpoint (at most {TERM_DRAIN_TIMEOUT:g} s)")
            self.write_exclude(control)
            self.drain_agents(TERM_DRAIN_TIMEOUT)
            self.processes.stop_all(grace=5.0)
            say(f"stopped at commit {newest_commit(self.checkpoint_dir)} (exit {SIGNAL_EXIT + signal.SIGTERM})")
            return SIGNAL_EXIT + signal.SIGTERM
        preempted = job_exit is None
        if preempted:
            say("USR1: the time limit or a preemption is near: draining the agents to a checkpoint")
        self.write_exclude(control)
        self.drain_agents(DRAIN_TIMEOUT if preempted else AGENTS_STOP)
        self.processes.stop_all(grace=FOLLOWER_STOP)
        outcome = decide(
            job_exit,
            preempted,
            self.restarts,
            self.args.max_requeues,
            commit_before,
            newest_commit(self.checkpoint_dir),
        )
        say(f"{outcome.reason} (exit {outcome.exit_code})")
        return outcome.exit_code

    def excluded(self) -> list[dict[str, Any]]:
        """The hosts earlier runs gave up on, with why (STATE/JOB/exclude.json); [] when it cannot be read."""
        try:
            return exclusions.load(self.job_dir)
        except ValueError as exc:
            say(f"cannot read {self.job_dir / exclusions.WHY} ({exc}): the excluded hosts are not shown")
            return []

    def write_exclude(self, control: str) -> None:
        """STATE/JOB/exclude (and exclude.json, with why): the hosts blacklisted now, with those of earlier runs, for
        the requeued job."""
        plane = ControlPlane(Endpoints.from_env(control), self.keys, timeout=1.0)
        try:
            hosts = plane.call("discovery", "hosts")
        except CommandError as exc:
            say(f"cannot ask discovery for blacklisted hosts ({exc})")
            hosts = {}
        finally:
            plane.close()
        excluded = exclusions.merged(self.excluded(), hosts, self.restarts + 1)
        if excluded:
            exclusions.save(self.job_dir, excluded)
            say(f"excluded from the requeued allocation: {', '.join(e['host'] for e in excluded)}")

    def join(self) -> int:
        """Agents only, in the control plane of the job joined, until this allocation ends or that job does."""
        signal.signal(signal.SIGTERM, self._on_signal)
        try:
            control = (self.job_dir / "control").read_text().strip()
        except OSError:
            say(f"job {self.args.join} has no control plane recorded in {self.job_dir}")
            return 2
        say(f"joining job {self.args.join} (control plane at {control})")
        try:
            joined = frozenset(
                n for job in commands.running_jobs() if job.het_job_id == self.args.join for n in job.nodes
            )
        except commands.SlurmError as exc:
            say(f"cannot read the joined job's nodes ({exc})")
            joined = frozenset()
        self.start_agents(control, skip=joined)
        while not self.received:
            if all(p.poll() is not None for p in self.processes.running.values()):
                break
            time.sleep(0.2)
        self.processes.stop_all(grace=5.0)
        return 0


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    own, run_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m elastic_control_plane.slurm.batch")
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--control", default=None)
    parser.add_argument("--control-hosts", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=None)
    parser.add_argument("--max-requeues", type=int, default=20)
    parser.add_argument("--join", default=None)
    return parser.parse_args(own), run_args


def main(argv: list[str] | None = None) -> int:
    args, run_args = parse(sys.argv[1:] if argv is None else argv)
    if "SLURM_JOB_ID" not in os.environ:
        say("not in a Slurm job (SLURM_JOB_ID is unset): submit it with elasticctl slurm")
        return 2
    driver = Driver(args, run_args)
    return driver.join() if args.join else driver.main()


if __name__ == "__main__":
    sys.exit(main())
