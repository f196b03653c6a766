"""The agent's side of the collective probe (`--collective-probe`): its process (agent/probe_process.py), started
with the agent and kept for its life, and the probes discovery asks of it.

`report()` is sent inside the host's health report (agent/host_health.py): `{store, id, seconds, collective_s,
error}`: the address of the store this host serves for a probe it would lead (None while the process starts), and
the last probe's result. Discovery (services/discovery/collective_probe.py) asks for a probe in a heartbeat's reply,
`probe: {id, rank, size, store}`; `assign()` checks it and hands it to the process. Nothing in a reply names a
command: a probe is four values, and the process only runs its fixed workload with them.

A reader thread takes the process's lines and wakes the agent's loop (`wake`), which sends the new report at once;
a process that exits is said (the report's `error`, its store None: discovery holds the host meanwhile) and started
again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

MAX_ADDRESS = 300
RESTART_AFTER = 5.0  # seconds before a probe process that exited is started again
# glibc raises its mmap threshold after the first large free, so each probe's 4 MiB tensors and gloo's buffers came
# from the heap and fragmented it: 0.2-1.1 MiB more resident per probe, without end (bench/probe_soak.py). A fixed
# threshold gives large blocks back when freed.
PROBE_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def probe_command(address: str) -> list[str]:
    return [sys.executable, "-m", "elastic_control_plane.agent.probe_process", address]


def valid_assignment(probe: Any) -> dict[str, Any] | None:
    """A probe discovery asks for, with plain values; None for anything else."""
    if not isinstance(probe, dict):
        return None
    ints = [probe.get(name) for name in ("id", "rank", "size")]
    if not all(isinstance(value, int) and not isinstance(value, bool) for value in ints):
        return None
    probe_id, rank, size = ints
    store = probe.get("store")
    if not (0 <= rank < size <= 4096 and isinstance(store, str) and 0 < len(store) <= MAX_ADDRESS and ":" in store):
        return None
    return {"id": probe_id, "rank": rank, "size": size, "store": store}


class CollectiveProbe:
    def __init__(self, address: str, wake: Callable[[], None], log: Any) -> None:
        self.address, self.wake, self.log = address, wake, log
        self._lock = threading.Lock()
        self._report: dict[str, Any] = {"store": None, "id": None, "seconds": None, "collective_s": None, "error": None}
        self._assigned: int | None = None
        self._closed = threading.Event()
        self.process = self._start()
        self._reader = threading.Thread(target=self._read, name="collective-probe", daemon=True)
        self._reader.start()

    def _start(self) -> subprocess.Popen[str]:
        return subprocess.Popen(
            probe_command(self.address),
            env={**os.environ, **PROBE_ENV},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def report(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._report)

    def assign(self, probe: Any) -> None:
        """Discovery asks for a probe (from a heartbeat's reply): run it unless it is the one asked last."""
        checked = valid_assignment(probe)
        if checked is None or checked["id"] == self._assigned or self.process.poll() is not None:
            return
        self._assigned = checked["id"]
        self.log.info("collective_probe_assigned", probe=checked["id"], rank=checked["rank"], size=checked["size"])
        try:
            self.process.stdin.write(json.dumps(checked) + "\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError):  # the process is gone: the reader says so and starts another
            pass

    def _read(self) -> None:
        """The process's lines, for its life; a process that exits is said, and started again RESTART_AFTER
        seconds later (until the agent closes)."""
        while True:
            for line in self.process.stdout:
                self._take(line)
            code = self.process.wait()
            if self._closed.is_set():
                return
            with self._lock:
                self._report.update(store=None, error=f"the probe process exited (code {code})")
            self.log.warning("collective_probe_process_exited", code=code, restart_in_s=RESTART_AFTER)
            self.wake()
            if self._closed.wait(RESTART_AFTER):
                return
            self.process = self._start()

    def _take(self, line: str) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            return
        with self._lock:
            self._report["store"] = message.get("store")
            if "id" in message:
                self._report.update(
                    id=message["id"],
                    seconds=message.get("seconds"),
                    collective_s=message.get("collective_s"),
                    error=message.get("error"),
                )
        if "id" in message:
            self.log.info("collective_probe_ran", **{k: v for k, v in message.items() if k != "store"})
        self.wake()

    def close(self) -> None:
        """Stop the process and its reader (before the agent closes what `wake` writes to)."""
        self._closed.set()
        self.wake = lambda: None
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self._reader.join(timeout=5)
