"""The operator's discovery script: one run at a time, in the background, and the hosts it printed.

Discovery runs the script every `discovery_poll` seconds, and waits for a run when a job is configured or
restored. A run that cannot start, exits non-zero or prints what is not a host list (`parse_script_output`)
is logged and yields nothing: the hosts the last good run printed stay in force.
"""

from __future__ import annotations

import re
import subprocess

import structlog


class DiscoveryScript:
    """Runs the script at `path` (None: no script) and reads what it prints; `wait_timeout` bounds a waited-for run."""

    def __init__(self, log: structlog.stdlib.BoundLogger, wait_timeout: float) -> None:
        self.path: str | None = None
        self._log = log
        self._wait_timeout = wait_timeout
        self._proc: subprocess.Popen[str] | None = None

    def run(self, wait: bool) -> dict[str, int | None] | None:
        """Start a run unless one is under way; once it has finished (waited for up to `wait_timeout` when `wait`),
        the hosts it printed, else None. Without a script, None at once."""
        if not self.path:
            return None
        if self._proc is None:
            try:
                self._proc = subprocess.Popen([self.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # type: ignore[list-item]
            except OSError as exc:
                self._log.warning("discovery_script_failed", script=self.path, reason=str(exc))
                return None
        proc = self._proc
        if wait:
            try:
                proc.wait(timeout=self._wait_timeout)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            return None
        self._proc = None
        out, err = proc.communicate()
        if proc.returncode != 0:
            self._log.warning(
                "discovery_script_failed", script=self.path, exit_code=proc.returncode, stderr=err.strip()[-500:]
            )
            return None
        try:
            return parse_script_output(out)
        except ValueError as exc:
            self._log.warning("discovery_script_bad_output", script=self.path, reason=str(exc))
            return None

    def stop(self) -> None:
        """Kill a run under way."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()


def parse_script_output(text: str) -> dict[str, int | None]:
    """Lines `host` or `host:slots`; blank lines and '#' comments ignored."""
    hosts: dict[str, int | None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, slots = line.partition(":")
        if not name.strip() or " " in name.strip() or (sep and not re.fullmatch(r"[0-9]+", slots.strip())):
            raise ValueError(f"line {number}: {line!r} is not 'host' or 'host:slots'")
        hosts[name.strip()] = int(slots) if sep else None
    return hosts
