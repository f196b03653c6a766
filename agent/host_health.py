"""The host's health checks: what they are, how one run goes, and when they run.

A run is the built-in checks, then the operator's `--health-check` command:
- /dev/shm has at least `min_shm_mib` MiB free (workers' shared memory, the host's snapshot);
- the memory available (MemAvailable) is at least `min_memory_mib` MiB;
- on a host that hands out GPUs, at least as many are visible to the driver (/proc/driver/nvidia, nvidia-smi) as
  when the agent started, and NVML finds none of the machine's GPUs failing (agent/nvml_state.py: retired pages
  pending, a failed row remapping, uncorrectable ECC errors); without GPUs, or with a driver that shows none (a
  container without its files), the check is skipped (said once in the log);
- the command, run with `sh -c` in a session of its own (under a shell that keeps its exit status), must exit 0
  within `timeout` seconds: past it, its whole process group is killed and the run fails; the group is killed after
  a run in any case, so nothing it started outlives it. The last lines of its output are logged and the last one
  is the failure's reason.

The command comes only from the agent's own command line: nothing discovery sends names a command or changes one
(a heartbeat reply may only ask for a run, by number).

A run goes in a thread of its own, never in the agent's loop, and wakes the loop through `fileno()` when it ends.
The checks run once at the start (the host is not available before they pass), again when discovery asks (`ask`:
a host whose cooldown ended or that an operator uncordoned), and every `interval` seconds while the last run
failed (`due`). `report()` is what the agent sends with its registration and heartbeats
(services/discovery/bodies.py `health`); `unready()` is why its /readyz says not ready (bus/health.py).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_control_plane.agent import nvml_state
from elastic_control_plane.agent.collective_probe import CollectiveProbe
from elastic_control_plane.agent.gpus import PROC_GPUS, nvidia_smi_gpu_count, proc_gpu_count

SHM = Path("/dev/shm")
MEMINFO = Path("/proc/meminfo")
OUTPUT_LINES = 5  # the last lines of the command's output that are logged
OUTPUT_TAIL_BYTES = 64 * 1024  # the output read back for its last lines
MIB = 1024 * 1024
# The command runs under a shell that writes its exit status to a file: the agent reaps any child it does not know
# (slot_processes/forking.py `reap_orphans`), so the status Popen would read may be gone.
WRAPPER = '/bin/sh -c "$1"; echo $? > "$2"'


@dataclass(frozen=True)
class HealthSettings:
    """The checks of one host: the operator's command (None: the built-in checks only), its timeout, how often a
    failing host checks again, the floors of free /dev/shm and memory (0: not checked), and the GPUs the driver
    showed when the agent started, on a host that hands GPUs out (0: not checked)."""

    command: str | None = None
    timeout: float = 30.0
    interval: float = 30.0
    min_shm_mib: float = 16.0
    min_memory_mib: float = 256.0
    gpus: int = 0
    probe_address: str | None = None  # where the collective probe's process serves its store (None: no probe)


def check_settings(settings: HealthSettings) -> None:
    """Raise ValueError naming the option when a setting cannot work."""
    if not settings.timeout > 0:
        raise ValueError(f"--health-check-timeout must be more than 0 seconds (got {settings.timeout:g})")
    if not settings.interval > 0:
        raise ValueError(f"--health-check-interval must be more than 0 seconds (got {settings.interval:g})")
    for option, value in (("--health-min-shm", settings.min_shm_mib), ("--health-min-memory", settings.min_memory_mib)):
        if value < 0:
            raise ValueError(f"{option} must be 0 MiB or more (got {value:g})")
    if settings.command is not None and not settings.command.strip():
        raise ValueError("--health-check must be a command (got an empty one)")


def available_memory_mib(meminfo: Path = MEMINFO) -> float | None:
    """MemAvailable in MiB; None where the kernel does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def visible_gpus() -> int:
    count = proc_gpu_count(PROC_GPUS)
    if count is not None:
        return count
    binary = shutil.which("nvidia-smi")
    return nvidia_smi_gpu_count(binary) if binary else 0


def builtin_failure(settings: HealthSettings, shm: Path = SHM, nvml: Any | None = None) -> str | None:
    """Why the built-in checks fail (None: they pass)."""
    if settings.min_shm_mib:
        try:
            free = shutil.disk_usage(shm).free / MIB
        except OSError as exc:
            return f"{shm} cannot be read: {exc.strerror}"
        if free < settings.min_shm_mib:
            return f"{shm} has {free:.0f} MiB free, below {settings.min_shm_mib:g} MiB"
    memory = available_memory_mib() if settings.min_memory_mib else None
    if memory is not None and memory < settings.min_memory_mib:
        return f"{memory:.0f} MiB of memory available, below {settings.min_memory_mib:g} MiB"
    if settings.gpus and (seen := visible_gpus()) < settings.gpus:
        return f"{seen} of the host's {settings.gpus} GPU(s) visible"
    return nvml_state.gpus_failure(nvml) if settings.gpus else None


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass(frozen=True)
class Outcome:
    ok: bool
    reason: str
    output: list[str]


class CommandRun:
    """One run of the operator's command; `stop()` (from the loop) kills it at once."""

    def __init__(self, command: str, timeout: float) -> None:
        self.command, self.timeout = command, timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._stopped = threading.Event()

    def run(self) -> Outcome:
        with tempfile.TemporaryFile() as output, tempfile.NamedTemporaryFile(prefix="health-status-") as status:
            try:
                self.process = subprocess.Popen(
                    ["/bin/sh", "-c", WRAPPER, "health-check", self.command, status.name],
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as exc:
                return Outcome(False, f"did not start: {exc.strerror}", [])
            try:
                self.process.wait(self.timeout)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            kill_group(self.process.pid)  # what it left behind, or the whole check past its timeout
            self.process.wait()
            output.seek(max(0, output.tell() - OUTPUT_TAIL_BYTES))  # a check that printed megabytes: its end only
            lines = output.read().decode(errors="replace").splitlines()[-OUTPUT_LINES:]
            written = status.read().decode().strip()
        last = lines[-1].strip() if lines else ""
        if timed_out:
            return Outcome(False, f"timed out after {self.timeout:g}s", lines)
        code = int(written) if written.isdigit() else None
        if code != 0:
            why = "killed before it exited" if code is None else f"exit code {code}"
            return Outcome(False, why + (f": {last}" if last else ""), lines)
        return Outcome(True, "", lines)

    def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            kill_group(self.process.pid)


class HostHealth:
    def __init__(self, settings: HealthSettings, log: Any, clock: Callable[[], float] = time.time) -> None:
        self.settings, self.log, self.clock = settings, log, clock
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        self._thread: threading.Thread | None = None
        self._run: CommandRun | None = None
        self._outcome: Outcome | None = None
        self._started_for = 0  # the recheck the run under way answers
        self.asked = 0  # the highest recheck discovery asked for
        self._report: dict[str, Any] = {"ok": False, "reason": "", "checked_at": None, "request": 0, "next_check": None}
        self.probe = CollectiveProbe(settings.probe_address, self._wake, log) if settings.probe_address else None
        self._nvml = nvml_state.load() if settings.gpus else None
        if not settings.gpus:
            log.info("health_gpu_check_skipped", reason="this host hands out no GPUs, or the driver shows none")
        elif self._nvml is None:
            log.info("health_nvml_check_skipped", reason="libnvidia-ml.so.1 is absent or does not start")

    def fileno(self) -> int:
        return self._wake_read

    def report(self) -> dict[str, Any]:
        return {**self._report, "probe": self.probe.report()} if self.probe is not None else dict(self._report)

    def children(self) -> list[int]:
        """The agent's children these checks wait for themselves (the probe process: its exit code is its hold's
        reason), never to be reaped as orphans."""
        process = self.probe.process if self.probe is not None else None
        return [process.pid] if process is not None and process.returncode is None else []

    def ask_probe(self, probe: Any) -> None:
        """Discovery asks for a collective probe (a heartbeat reply's `probe`; ignored without one)."""
        if self.probe is not None and probe is not None:
            self.probe.assign(probe)

    def unready(self) -> str | None:
        """Why the host may not be given work by its checks (None: its last run passed), in discovery's words
        (services/discovery/admission.py): its first run goes on, or its last one failed (and until one passes).
        Read by the metrics thread for /readyz: the report is replaced, never changed in place."""
        report = self._report
        if report["checked_at"] is None:
            return "first health check running"
        return None if report["ok"] else f"health check failed: {report['reason']}"

    def start(self) -> None:
        """Begin a run unless one is under way."""
        if self._thread is not None:
            return
        self._started_for = self.asked
        self._run = CommandRun(self.settings.command, self.settings.timeout) if self.settings.command else None
        self._thread = threading.Thread(target=self._check, name="health-check", daemon=True)
        self._thread.start()

    def ask(self, request: Any) -> None:
        """Discovery asks for a run answering recheck `request` (a number; anything else is ignored)."""
        if isinstance(request, int) and not isinstance(request, bool) and request > self.asked:
            self.asked = request
            self.start()

    def due(self) -> None:
        """Every heartbeat: a host whose last run failed checks again once its interval is over."""
        next_check = self._report["next_check"]
        if next_check is not None and self.clock() >= next_check:
            self.start()

    def _check(self) -> None:
        failure = builtin_failure(self.settings, nvml=self._nvml)
        if failure is not None:
            self._outcome = Outcome(False, failure, [])
        else:
            self._outcome = self._run.run() if self._run is not None else Outcome(True, "", [])
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except OSError:  # the agent closed while the run went on: nobody reads it
            pass

    def finished(self) -> bool:
        """The loop, woken by a run's end: take its outcome; True when the report changed. A recheck asked while it
        ran starts another run."""
        try:
            os.read(self._wake_read, 64)
        except BlockingIOError:
            return False
        if self._thread is None or self._outcome is None:
            return self.probe is not None  # woken by the probe: its report may have changed
        self._thread.join()
        outcome, self._thread, self._run, self._outcome = self._outcome, None, None, None
        now = self.clock()
        before = self._report
        self._report = {
            "ok": outcome.ok,
            "reason": outcome.reason,
            "checked_at": round(now, 3),
            "request": self._started_for,
            "next_check": None if outcome.ok else round(now + self.settings.interval, 3),
        }
        if not outcome.ok or not before["ok"]:  # every failure, and the first pass after one
            log = self.log.info if outcome.ok else self.log.warning
            log(
                "health_checked", ok=outcome.ok, reason=outcome.reason, output=outcome.output, request=self._started_for
            )
        if self.asked > self._started_for:
            self.start()
        return True

    def stop(self) -> None:
        """The agent stops: a run under way is killed with everything it started."""
        if self._run is not None:
            self._run.stop()

    def close(self) -> None:
        self.stop()
        if self.probe is not None:
            self.probe.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
