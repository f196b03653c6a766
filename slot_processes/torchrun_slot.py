"""A torchrun-mode slot's supervisor: joins each round for its slot, then runs the user's command in it with
torchrun's environment, and starts it again at every new round.

The agent starts one per slot of a `--mode torchrun` job (`python -m elastic_control_plane.slot_processes.torchrun_slot
CMD...`) in place of the command itself; to the agent, the registry and the rendezvous it is the slot's worker (it joins
rounds, its exit is the slot's exit). It lives as long as the slot. Spawned, it never imports torch (a small interpreter
per slot); forked from the host's zygote, it shares the zygote's pages and costs what it writes.

In each round:
- it enters the round through its agent as libworker's workers do (slot_processes/rounds.py) and learns the slot's rank;
- rank 0's supervisor has a new store served for the round (`RoundStores`: a process of its own,
  slot_processes.round_store, forked from the seed where there is one, kept for the job, which serves a fresh TCPStore
  per round, as torchrun's agent does) and publishes `address:port` under the round's prefix in the rendezvous
  key-value store; the others read it there, unless the round was aborted first (then they enter the next). The
  commands connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True), so none of them serves a store its peers
  still use when it exits. The supervisor of local rank 0 starts its store server at once (rank 0 is nearly always
  some host's local rank 0), any other when it first holds rank 0;
- it starts the command with torchrun's variables for the slot (`torchrun_environment`), in a process group of
  its own (so stopping it stops its children too, e.g. data-loader workers).

How the command starts. Where the host's fork server serves the job (agent/fork_server.py), the agent forks this
supervisor from the zygote: it starts with torch already imported. Before it starts any thread it forks a `CommandSeed`
(slot_processes/command_seed.py), a copy of itself that only waits, and every round's command (`python SCRIPT ARGS` or
`python -m MODULE ARGS`) is forked from that seed (slot_processes/forking.py's protocol: re-parented to this supervisor,
a child subreaper, and run as `__main__` with torchrun's environment), so a round's workers never wait for a fresh
interpreter and `import torch`, the first round's included; the seed shares the zygote's memory. A spawned supervisor
(fork servers off, a command that is not a Python script) starts each command as a fresh interpreter; a seed that dies
does too, from then on, with one line.

What ends the command's round, as torchrun ends its worker group's: the control plane aborting the round (a
peer failed), or a change of the job's hosts newer than the round (a host added, lost or drained). The command
gets SIGTERM, then SIGKILL after `STOP_GRACE` seconds, and the supervisor joins the next round. When the command
exits by itself:
- with 0: the supervisor exits 0 (the slot succeeded; the job is done);
- otherwise, unless its round was already ending (a peer's failure brought it down), the supervisor tells the
  agent (`child_failed`), which reports it to the registry as a worker restarted in place, and joins the next
  round; the registry aborts the round for every other slot.
SIGTERM or SIGINT to the supervisor (the job's end, the agent stopping) stops the command the same way, then the
supervisor exits as the command did (killed by the same signal, when it was); between commands it dies of the
signal at once. The command and the seed die with the supervisor (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from elastic_control_plane.bus.client import ServiceError, Unreachable
from elastic_control_plane.bus.config import Timing
from elastic_control_plane.bus.contract import WorkerEnv
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.bus.lifetime import die_with_parent
from elastic_control_plane.slot_processes.agent_link import link_to_agent, worker_pid
from elastic_control_plane.slot_processes.command_seed import CommandSeed, SeedGone
from elastic_control_plane.slot_processes.forking import ForkedProcess, WorkerProcess, reap_orphans
from elastic_control_plane.slot_processes.rounds import (
    RoundAborted,
    enter_round,
    publish_store,
    read_store,
    wait_for_a_slot,
)
from elastic_control_plane.slot_processes.warm_start import script_argv

STOP_GRACE = 5.0
POLL = 0.01
UNLIMITED_RESTARTS = 2**31 - 1


def torchrun_environment(
    slot: Mapping[str, Any], master: str, max_restarts: int | None, run_id: str, base: Mapping[str, str]
) -> dict[str, str]:
    """What torchrun (`torch.distributed.run`) sets for a worker, for `slot` (the rendezvous' answer to a join) with
    the round's store at `master` ("address:port"): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the
    host's place among the round's hosts), GROUP_WORLD_SIZE, ROLE_*, MASTER_*, TORCHELASTIC_* and, as torchrun does
    for more than one process per host, OMP_NUM_THREADS=1 unless it is set. TORCHELASTIC_RESTART_COUNT counts the
    times the job's workers were started again: each round after the first is one, a change of hosts included
    (torchrun counts its failure restarts there; the reset limit, TORCHELASTIC_MAX_RESTARTS, counts those)."""
    address, port = master.rsplit(":", 1)
    rank, size, local_size = int(slot["rank"]), int(slot["size"]), int(slot["local_size"])
    env = {
        "RANK": rank,
        "WORLD_SIZE": size,
        "LOCAL_RANK": int(slot["local_rank"]),
        "LOCAL_WORLD_SIZE": local_size,
        "GROUP_RANK": int(slot["cross_rank"]),
        "GROUP_WORLD_SIZE": int(slot["cross_size"]),
        "ROLE_NAME": "default",
        "ROLE_RANK": rank,
        "ROLE_WORLD_SIZE": size,
        "MASTER_ADDR": address,
        "MASTER_PORT": port,
        "TORCHELASTIC_RESTART_COUNT": int(slot["round"]) - 1,
        "TORCHELASTIC_MAX_RESTARTS": UNLIMITED_RESTARTS if max_restarts is None else max_restarts,
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        WorkerEnv.SNAPSHOT_WRITER: "1" if slot.get("snapshot_writer") else "0",
    }
    chosen = {name: str(value) for name, value in env.items()}
    if local_size > 1 and "OMP_NUM_THREADS" not in base:
        chosen["OMP_NUM_THREADS"] = "1"
    return chosen


class RoundStores:
    """This slot's store server (slot_processes.round_store), started once (forked from the seed where there is one): a
    new store for each round it serves."""

    def __init__(self, address: str, seed: CommandSeed | None) -> None:
        self.address, self.seed = address, seed
        self.process: WorkerProcess | None = None
        self.requests: IO[bytes] | None = None
        self.ports: IO[bytes] | None = None

    def start(self) -> None:
        if self.process is not None:
            return
        command = [sys.executable, "-m", "elastic_control_plane.slot_processes.round_store", self.address]
        if self.seed is not None:
            (requests_read, requests_write), (ports_read, ports_write) = os.pipe(), os.pipe()
            try:
                forked = self.seed.fork(command, os.environ, (requests_read, ports_write, 2))
            except SeedGone as exc:
                say(f"{exc}; the round's store server starts as a fresh interpreter")
                forked = None
            finally:
                os.close(requests_read)
                os.close(ports_write)
            if forked is not None:
                self.process, self.requests, self.ports = (
                    forked,
                    os.fdopen(requests_write, "wb"),
                    os.fdopen(ports_read, "rb"),
                )
                return
            os.close(requests_write)
            os.close(ports_read)
        spawned = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_parent()
        )
        self.process, self.requests, self.ports = spawned, spawned.stdin, spawned.stdout

    def next_store(self) -> str:
        """`address:port` of a new store for this round."""
        self.start()
        assert self.requests is not None and self.ports is not None
        try:
            self.requests.write(b"next\n")
            self.requests.flush()
            port = self.ports.readline().strip()
        except BrokenPipeError:
            port = b""
        if not port.isdigit():
            self.close()
            raise RuntimeError("the store server exited")
        return f"{self.address}:{int(port)}"

    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def close(self) -> None:
        for stream in (self.requests, self.ports):
            if stream is not None:
                stream.close()
        if self.process is not None:
            _stop(self.process)
        self.process = self.requests = self.ports = None


class SlotSupervisor:
    def __init__(self, command: list[str], seed: CommandSeed | None) -> None:
        self.command = command
        self.timing = Timing.from_env()
        self.link = link_to_agent(self.timing)
        self.local_rank = self.link.local_rank
        self.slot: dict[str, Any] = {}
        self.round = 0
        self.aborted_round = 0
        self.newest_hosts_update = 0.0
        self.stop_signal: int | None = None
        self.child: WorkerProcess | None = None
        self.lock = threading.Lock()
        self.seed = seed
        self.stores = RoundStores(os.environ.get(WorkerEnv.ADVERTISE_ADDR, "127.0.0.1"), seed)
        self.link.listeners.append(self._on_event)
        self.link.wait_subscribed(5.0)

    # -- events (the link's thread) and signals ---------------------------------------------------
    def _on_event(self, msg: Message) -> None:
        with self.lock:
            if msg.type == "abort" and isinstance(msg.body.get("round"), int):
                self.aborted_round = max(self.aborted_round, msg.body["round"])
            elif msg.type == "hosts_updated":
                self.newest_hosts_update = max(self.newest_hosts_update, float(msg.body.get("timestamp", 0.0)))

    def _on_stop_signal(self, signum: int, _frame: Any) -> None:
        """While a command runs, it is stopped first (the wait loop sees the flag); between commands (joining,
        waiting for a slot) the supervisor dies of the signal at once, and its helpers with it (PR_SET_PDEATHSIG)."""
        self.stop_signal = signum
        if self.child is None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def round_ending(self) -> bool:
        with self.lock:
            return self.aborted_round >= self.round or self.newest_hosts_update > float(
                self.slot.get("hosts_timestamp", 0.0)
            )

    # -- the slot's life --------------------------------------------------------------------------
    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_stop_signal)
        if self.local_rank == 0:
            self.stores.start()
        try:
            return self._serve()
        finally:
            self.stores.close()
            if self.seed is not None:
                self.seed.close()

    def _serve(self) -> int:
        if os.environ.get(WorkerEnv.STANDBY):
            self.local_rank = wait_for_a_slot(self.link)
        while self.stop_signal is None:
            if not self._enter_round():
                return 0
            try:
                master = self._round_store_address()
            except (Unreachable, ServiceError, RuntimeError, RoundAborted) as exc:
                say(f"round {self.round}: no store ({exc}); joining the next round")
                continue
            code = self._run_round(master)
            if code is not None:
                return code
        return 0

    def _enter_round(self) -> bool:
        """Enter the round after this slot's last one; False when the slot is not in it (the supervisor leaves)."""
        slot = enter_round(self.link, self.local_rank, self.round)
        if slot is None:
            return False
        with self.lock:
            self.slot = slot
            self.round = int(slot["round"])
        return True

    def _round_store_address(self) -> str:
        """`address:port` of the round's store: rank 0's supervisor has a new one served and publishes it."""
        if self.slot["rank"] == 0:
            master = self.stores.next_store()
            publish_store(self.link, self.slot, master, self._round_aborted, self.timing.collective_timeout)
            return master
        return read_store(self.link, self.slot, self._round_aborted, self.timing.collective_timeout)

    def _round_aborted(self) -> bool:
        with self.lock:
            return self.aborted_round >= self.round

    def _run_round(self, master: str) -> int | None:
        """Run the command in this round; its exit code when the supervisor ends with it, None to join the next."""
        max_restarts = os.environ.get(WorkerEnv.RESET_LIMIT)
        env = {
            **os.environ,
            **torchrun_environment(
                self.slot,
                master,
                int(max_restarts) if max_restarts else None,
                os.environ.get(WorkerEnv.JOB_KEY, ""),
                os.environ,
            ),
        }
        child = self.child = self._start_command(env)
        self._tell_started(child)
        try:
            return self._watch(child)
        finally:
            self.child = None

    def _start_command(self, env: dict[str, str]) -> WorkerProcess:
        """The round's command: forked from the seed where there is one, else a fresh interpreter."""
        if self.seed is not None:
            try:
                return self.seed.fork(self.command, env)
            except SeedGone as exc:
                say(f"{exc}; commands start as fresh interpreters (seconds per restart)")
            self.seed.close()
            self.seed = self.stores.seed = None
        return subprocess.Popen(self.command, env=env, start_new_session=True, preexec_fn=die_with_parent())

    def _tell_started(self, child: WorkerProcess) -> None:
        """The agent logs each round's command (`command_started`: its pid, and whether it was forked)."""
        body = {
            "local_rank": self.local_rank,
            "pid": worker_pid(),
            "command_pid": child.pid,
            "forked": isinstance(child, ForkedProcess),
            "round": self.round,
        }
        try:
            self.link.requests.request("command_started", body, timeout=5.0, deadline=30.0)
        except (Unreachable, ServiceError) as exc:
            say(f"could not tell the agent: {exc}")

    def _known_children(self) -> set[int]:
        """The children this supervisor waits for itself (the rest re-parented to it are reaped as orphans)."""
        return {pid for pid in (self.seed and self.seed.pid, self.child and self.child.pid, self.stores.pid()) if pid}

    def _watch(self, child: WorkerProcess) -> int | None:
        while (code := _wait(child, POLL)) is None:
            reap_orphans(self._known_children())
            if self.stop_signal is not None:
                return _stop(child)
            if self.round_ending():
                _stop(child)
                return None
        if code == 0:
            return 0
        if not self.round_ending():
            self._report_failure(child.pid, code)
        return None

    def _report_failure(self, child_pid: int, code: int) -> None:
        say(
            f"round {self.round}: the command (pid {child_pid}) exited with code {code}; every worker starts "
            "again in the next round"
        )
        try:
            self.link.requests.request(
                "child_failed",
                {"local_rank": self.local_rank, "pid": worker_pid(), "exit_code": code},
                timeout=5.0,
                deadline=30.0,
            )
        except (Unreachable, ServiceError) as exc:
            say(f"could not tell the agent: {exc}")


def _wait(child: WorkerProcess, timeout: float) -> int | None:
    """The child's exit code once it exits within `timeout` seconds, else None (spawned or forked alike)."""
    deadline = time.monotonic() + timeout
    while (code := child.poll()) is None and time.monotonic() < deadline:
        time.sleep(min(0.005, timeout))
    return code


def _stop(child: WorkerProcess) -> int:
    """SIGTERM to the command's process group, SIGKILL after STOP_GRACE; its exit code."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass
        code = _wait(child, STOP_GRACE)
        if code is not None:
            return code
    return child.wait()


def say(line: str) -> None:
    sys.stderr.write(f"torchrun-slot: {line}\n")
    sys.stderr.flush()


def main() -> None:
    command = sys.argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.exit("usage: python -m elastic_control_plane.slot_processes.torchrun_slot [--] COMMAND [ARGS...]")
    forked_from_a_zygote = "torch" in sys.modules  # a spawned supervisor never imports it
    seed = CommandSeed() if forked_from_a_zygote and script_argv(command) is not None else None
    code = SlotSupervisor(command, seed).run()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
