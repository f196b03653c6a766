"""A torchrun-mode slot's supervisor: joins each round for its slot, then runs the user's command in it with
torchrun's environment, and starts it again at every new round.

The agent starts one per slot of a `--mode torchrun` job (`python -m agent.torchrun_slot CMD...`) in place of the
command itself; to the agent, the registry and the rendezvous it is the slot's worker (it joins rounds, its exit is
the slot's exit). It never imports torch: it costs a small interpreter per slot and lives as long as the slot.

In each round:
- it joins through its agent (`rank_and_size`, as libworker's `join()` does) and learns the slot's rank;
- rank 0's supervisor has a new store served for the round (`RoundStores`: a process of its own,
  libworker.round_store, kept for the job, which serves a fresh TCPStore per round, as torchrun's agent does)
  and publishes `address:port` under the round's prefix in the rendezvous key-value store; the others read it
  there. The commands connect to it as clients (TORCHELASTIC_USE_AGENT_STORE=True), so none of them serves a
  store its peers still use when it exits. The supervisor of local rank 0 starts its store server at once (rank 0
  is nearly always some host's local rank 0), any other when it first holds rank 0;
- it starts the command with torchrun's variables for the slot (`torchrun_environment`), in a process group of
  its own (so stopping it stops its children too, e.g. data-loader workers). A command of the form `python
  SCRIPT ARGS` or `python -m MODULE ARGS` starts warm: the supervisor keeps an interpreter that has imported
  torch waiting (libworker.warm_start, started `WARM_DELAY` seconds into a round, so it does not compete with
  the round's start) and hands it the command, so a new round's workers do not wait for `import torch`. A warm
  interpreter that failed to start (libworker not importable by the command's python) turns warm starts off
  for the slot, with one line; `ELASTIC_WARM_START=0` turns them off for a job.

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
signal at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from agent.fork_server import script_argv
from bus.agent_link import AgentLink, worker_pid
from bus.client import ServiceError, Unreachable
from bus.config import Timing
from bus.contract import WorkerEnv
from bus.envelope import Message
from bus.lifetime import die_with_parent

JOIN_DEADLINE = 7 * 24 * 3600.0
WARM_DELAY = 2.0
STOP_GRACE = 5.0
POLL = 0.01
ORPHAN_AFTER_MIN, ORPHAN_AFTER_HEARTBEATS = 30.0, 20
UNLIMITED_RESTARTS = 2**31 - 1


def torchrun_environment(slot: Mapping[str, Any], master: str, max_restarts: int | None, run_id: str, base: Mapping[str, str]) -> dict[str, str]:
    """What torchrun (`torch.distributed.run`) sets for a worker, for `slot` (the rendezvous' answer to a join) with
    the round's store at `master` ("address:port"): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (the
    host's place among the round's hosts), GROUP_WORLD_SIZE, ROLE_*, MASTER_*, TORCHELASTIC_* and, as torchrun does
    for more than one process per host, OMP_NUM_THREADS=1 unless it is set. TORCHELASTIC_RESTART_COUNT counts the
    times the job's workers were started again: each round after the first is one, a change of hosts included
    (torchrun counts its failure restarts there; the reset limit, TORCHELASTIC_MAX_RESTARTS, counts those)."""
    address, port = master.rsplit(":", 1)
    rank, size, local_size = int(slot["rank"]), int(slot["size"]), int(slot["local_size"])
    env = {
        "RANK": rank, "WORLD_SIZE": size, "LOCAL_RANK": int(slot["local_rank"]), "LOCAL_WORLD_SIZE": local_size,
        "GROUP_RANK": int(slot["cross_rank"]), "GROUP_WORLD_SIZE": int(slot["cross_size"]),
        "ROLE_NAME": "default", "ROLE_RANK": rank, "ROLE_WORLD_SIZE": size,
        "MASTER_ADDR": address, "MASTER_PORT": port,
        "TORCHELASTIC_RESTART_COUNT": int(slot["round"]) - 1,
        "TORCHELASTIC_MAX_RESTARTS": UNLIMITED_RESTARTS if max_restarts is None else max_restarts,
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_USE_AGENT_STORE": "True",
        WorkerEnv.SNAPSHOT_WRITER: "1" if slot.get("snapshot_writer") else "0",
    }
    chosen = {name: str(value) for name, value in env.items()}
    if local_size > 1 and "OMP_NUM_THREADS" not in base:
        chosen["OMP_NUM_THREADS"] = "1"
    return chosen


class RoundStores:
    """This slot's store server (libworker.round_store), started once: a new store for each round it serves."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self.process is None:
            self.process = subprocess.Popen([sys.executable, "-m", "libworker.round_store", self.address], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_parent())

    def next_store(self) -> str:
        """`address:port` of a new store for this round."""
        self.start()
        assert self.process is not None and self.process.stdin is not None and self.process.stdout is not None
        try:
            self.process.stdin.write(b"next\n")
            self.process.stdin.flush()
            port = self.process.stdout.readline().strip()
        except BrokenPipeError:
            port = b""
        if not port.isdigit():
            self.process = None
            raise RuntimeError("the store server exited")
        return f"{self.address}:{int(port)}"

    def close(self) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None


class WarmStart:
    """The slot's waiting warm interpreter (at most one), for the next round's command."""

    def __init__(self, command: list[str]) -> None:
        self.python, self.argv = command[0], script_argv(command)
        self.enabled = self.argv is not None and os.environ.get("ELASTIC_WARM_START", "1") != "0"
        self.process: subprocess.Popen[bytes] | None = None

    def prepare(self) -> None:
        if self.enabled and self.process is None:
            self.process = subprocess.Popen([self.python, "-m", "libworker.warm_start"], stdin=subprocess.PIPE, start_new_session=True,
                                            preexec_fn=die_with_parent())

    def take(self, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        """Hand the command to the waiting interpreter; None when there is none (it is then started cold)."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is not None:
            self.enabled = False
            say(f"warm start unavailable (the warm interpreter exited with code {process.returncode}); commands start cold")
            return None
        assert process.stdin is not None and self.argv is not None
        try:
            process.stdin.write(json.dumps({"argv": self.argv, "env": env, "cwd": os.getcwd()}).encode() + b"\n")
            process.stdin.close()
        except BrokenPipeError:
            self.enabled = False
            return None
        return process

    def discard(self) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None


class SlotSupervisor:
    def __init__(self, command: list[str]) -> None:
        self.command = command
        self.timing = Timing.from_env()
        self.local_rank = int(os.environ.get(WorkerEnv.LOCAL_RANK, "-1"))
        orphan_after = max(ORPHAN_AFTER_MIN, ORPHAN_AFTER_HEARTBEATS * self.timing.heartbeat)
        self.link = AgentLink(os.environ[WorkerEnv.AGENT], os.environ.get(WorkerEnv.HOST, "?"), self.local_rank, orphan_after)
        self.slot: dict[str, Any] = {}
        self.round = 0
        self.aborted_round = 0
        self.newest_hosts_update = 0.0
        self.stop_signal: int | None = None
        self.child: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.warm = WarmStart(command)
        self.stores = RoundStores(os.environ.get(WorkerEnv.ADVERTISE_ADDR, "127.0.0.1"))
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
            return self.aborted_round >= self.round or self.newest_hosts_update > float(self.slot.get("hosts_timestamp", 0.0))

    # -- the slot's life --------------------------------------------------------------------------
    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._on_stop_signal)
        self.warm.prepare()
        if self.local_rank == 0:
            self.stores.start()
        try:
            return self._serve()
        finally:
            self.warm.discard()
            self.stores.close()

    def _serve(self) -> int:
        if os.environ.get(WorkerEnv.STANDBY):
            self._wait_for_a_slot()
        while self.stop_signal is None:
            if not self._join():
                return 0
            try:
                master = self._round_store_address()
            except (Unreachable, ServiceError, RuntimeError) as exc:
                say(f"round {self.round}: no store ({exc}); joining the next round")
                continue
            code = self._run_round(master)
            if code is not None:
                return code
        return 0

    def _wait_for_a_slot(self) -> None:
        reply = self.link.requests.request("standby", {"pid": worker_pid()}, timeout=5.0, deadline=JOIN_DEADLINE)
        self.local_rank = int(reply.body["local_rank"])
        self.link.local_rank = self.local_rank
        os.environ.update({WorkerEnv.LOCAL_RANK: str(self.local_rank), "LOCAL_RANK": str(self.local_rank)})
        del os.environ[WorkerEnv.STANDBY]

    def _join(self) -> bool:
        """Join the round after this slot's last one; False when the slot is not in it (the supervisor leaves)."""
        reply = self.link.requests.request(
            "rank_and_size", {"local_rank": self.local_rank, "after_round": self.round, "pid": worker_pid()}, timeout=5.0, deadline=JOIN_DEADLINE
        )
        if reply.body.get("removed"):
            return False
        with self.lock:
            self.slot = dict(reply.body)
            self.round = int(reply.body["round"])
        return True

    def _round_store_address(self) -> str:
        key = f"{self.slot['prefix']}master"
        if self.slot["rank"] == 0:
            master = self.stores.next_store()
            self.link.requests.request("kv_set", {"key": key}, raw=(master.encode(),))
            return master
        return self.link.requests.request("kv_get", {"key": key}, timeout=5.0, deadline=self.timing.collective_timeout).raw[0].decode()

    def _run_round(self, master: str) -> int | None:
        """Run the command in this round; its exit code when the supervisor ends with it, None to join the next."""
        max_restarts = os.environ.get(WorkerEnv.RESET_LIMIT)
        env = {**os.environ, **torchrun_environment(self.slot, master, int(max_restarts) if max_restarts else None,
                                                    os.environ.get(WorkerEnv.JOB_KEY, ""), os.environ)}
        child = self.child = self.warm.take(env) or subprocess.Popen(self.command, env=env, start_new_session=True, preexec_fn=die_with_parent())
        try:
            return self._watch(child)
        finally:
            self.child = None

    def _watch(self, child: subprocess.Popen[bytes]) -> int | None:
        warm_at = time.monotonic() + WARM_DELAY
        while (code := _wait(child, POLL)) is None:
            if time.monotonic() > warm_at:
                self.warm.prepare()
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
        say(f"round {self.round}: the command (pid {child_pid}) exited with code {code}; every worker starts again in the next round")
        try:
            self.link.requests.request("child_failed", {"local_rank": self.local_rank, "pid": worker_pid(), "exit_code": code}, timeout=5.0, deadline=30.0)
        except (Unreachable, ServiceError) as exc:
            say(f"could not tell the agent: {exc}")


def _wait(child: subprocess.Popen[bytes], timeout: float) -> int | None:
    try:
        return child.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _stop(child: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the command's process group, SIGKILL after STOP_GRACE; its exit code."""
    for signum, grace in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, None)):
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:
            pass
        try:
            return child.wait(grace)
        except subprocess.TimeoutExpired:
            continue
    return child.wait()


def say(line: str) -> None:
    sys.stderr.write(f"torchrun-slot: {line}\n")
    sys.stderr.flush()


def main() -> None:
    command = sys.argv[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        sys.exit("usage: python -m agent.torchrun_slot [--] COMMAND [ARGS...]")
    code = SlotSupervisor(command).run()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
