"""The wait record: how long a worker waits in collectives, written by the worker, read by its agent (both ends).

Every rank knows when it waits for the others. The worker writes it into a
small file its agent created in shared memory (`RECORD_ENV` names it) and
maps: no message, no system call and no lock per collective, and the agent
reads it whatever the worker is doing (even while a thread of the worker
holds the GIL in C). The agent turns it into the reports the registry judges
hangs and stragglers by (agent/wait_watch.py, services/registry/waits.py).

The record (`LAYOUT`, native byte order; one writer, the worker):
- `version`: odd while the worker writes (a seqlock: the reader retries);
- `waiting_since`: the monotonic instant the current wait began, 0 when not waiting (CLOCK_MONOTONIC is the
  host's, the same in the agent);
- `busy_since`: when the last wait of this round ended, 0 before the first;
- `waited_total`: seconds waited over the worker's life;
- `longest_wait`: the longest wait of this round, not counting its first IGNORED_WAITS (a round's first
  collectives wait for ranks that restore, load or compile), waits in Horovod's join, nor a wait that ended in
  an error (the round was aborted: the others waited for a rank that failed or hung) or in a user's error
  (`discount`);
- `typical_busy`: the usual time between two waits (a running mean of this round's intervals after its first
  IGNORED_WAITS, each capped at OUTLIER_CAP times the mean so an evaluation does not move it);
- `round`, `waits`: the round the worker is in and the waits it completed in it;
- `declared_until`, `declared_reason`: a wait the user's code declared (`declare`: a rank legitimately busy
  outside the collectives, libworker.elastic.waiting): until when (monotonic, 0 when none) and why (UTF-8, cut to
  REASON_BYTES). When it ends, the busy stretch begins again.

After the record, outside the seqlock, one field the agent writes and the worker reads: `excused_until`, until
when (monotonic) the worker's collectives may wait past the collective timeout, because the registry sees the
rank they wait for and will judge it (agent/wait_watch.py). An aligned 8-byte store: read whole or not at all.

Waits nest (a negotiation cycle waits inside the wait for its request): only
the outermost counts. The stack dump: a worker started by an agent registers
`faulthandler` for STACK_DUMP_SIGNAL into the file `STACK_ENV` names, so the
agent can ask for every thread's stack before it kills a hung worker (the
handler runs in C: it answers while the GIL is held).
"""

from __future__ import annotations

import faulthandler
import mmap
import os
import signal
import struct
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

from elastic_control_plane.snapshot.layout import CREATE_PRIVATE

RECORD_ENV = "ELASTIC_WAIT_RECORD"
STACK_ENV = "ELASTIC_STACK_FILE"
STACK_DUMP_SIGNAL = signal.SIGRTMIN + 5  # not SIGUSR1/2, which training tools and schedulers use
IGNORED_WAITS = 3
OUTLIER_CAP = 4.0
TYPICAL_WEIGHT = 0.05

REASON_BYTES = 64
LAYOUT = struct.Struct(f"=QdddddQQd{REASON_BYTES}s")
_VERSION = struct.Struct("=Q")
_BODY = struct.Struct(f"=dddddQQd{REASON_BYTES}s")
_EXCUSE = struct.Struct("=d")
EXCUSE_OFFSET = LAYOUT.size
RECORD_SIZE = EXCUSE_OFFSET + _EXCUSE.size
READ_TRIES = 100


@dataclass(frozen=True)
class WaitState:
    """One consistent read of a worker's record."""

    waiting_since: float
    busy_since: float
    waited_total: float
    longest_wait: float
    typical_busy: float
    round: int
    waits: int
    declared_until: float = 0.0
    declared_reason: str = ""


def create(path: str) -> None:
    """The agent makes a zeroed record for a worker about to start: new, owner-only, no link (OSError when the name
    is taken: see snapshot/layout.py's CREATE_PRIVATE)."""
    fd = os.open(path, CREATE_PRIVATE, 0o600)
    try:
        os.ftruncate(fd, RECORD_SIZE)
    finally:
        os.close(fd)


def _mapped(path: str) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, RECORD_SIZE)
    finally:
        os.close(fd)


class RecordReader:
    """The agent's view of one worker's record."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map = _mapped(path)

    def read(self) -> WaitState | None:
        """A consistent state (None when the writer kept writing through every try: it never does for long)."""
        for _ in range(READ_TRIES):
            (before,) = _VERSION.unpack_from(self._map, 0)
            body = _BODY.unpack_from(self._map, _VERSION.size)
            (after,) = _VERSION.unpack_from(self._map, 0)
            if before == after and before % 2 == 0:
                *numbers, reason = body
                return WaitState(*numbers, reason.rstrip(b"\0").decode(errors="replace"))
        return None

    def excuse(self, until: float) -> None:
        """The worker's collectives may wait past the collective timeout until `until` (monotonic)."""
        _EXCUSE.pack_into(self._map, EXCUSE_OFFSET, until)

    def close(self) -> None:
        self._map.close()


class WaitRecord:
    """The worker's end: `waiting()` around every wait for the others, `begin_round` when it enters a round,
    `declare` around a wait the user's code declares. Its writes take a lock: a declared wait may begin on another
    thread than the collectives."""

    def __init__(self, path: str) -> None:
        self._map = _mapped(path)
        self._version = 0
        self._depth = 0
        self._calibrates = self._next_calibrates = True
        self._state: list[Any] = [0.0, 0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, b""]
        self._declared: list[tuple[str, float]] = []  # the declared waits under way, innermost last
        self._lock = threading.RLock()

    def begin_round(self, number: int) -> None:
        state = self._state
        state[1], state[3], state[4], state[5], state[6] = 0.0, 0.0, 0.0, number, 0
        self._write()

    def __enter__(self) -> WaitRecord:
        self._depth += 1
        if self._depth == 1:
            self._calibrates, self._next_calibrates = self._next_calibrates, True
            self._state[0] = time.monotonic()
            self._write()
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        state = self._state
        now = time.monotonic()
        began, busy_since = state[0], state[1]
        waited = now - began
        state[0], state[1] = 0.0, now
        state[2] += waited
        state[6] += 1
        if state[6] > IGNORED_WAITS and self._calibrates and exc_type is None:
            state[3] = max(state[3], waited)
            if busy_since:
                busy = began - busy_since
                typical = state[4]
                state[4] = (
                    busy if not typical else typical + TYPICAL_WEIGHT * (min(busy, OUTLIER_CAP * typical) - typical)
                )
        self._write()

    def waiting(self, calibrates: bool = True) -> WaitRecord:
        """`with record.waiting():` around a wait for the others (nested waits count once); `calibrates=False`: a
        wait that says nothing of how long ranks normally wait for each other (Horovod's join: a rank out of data
        waits while the others train)."""
        if not self._depth:
            self._next_calibrates = calibrates
        return self

    def discount(self) -> None:
        """The wait under way ends in a user's error (a collective no other rank submitted, given up at the timeout):
        it says nothing of how long ranks normally wait, so it does not calibrate."""
        self._calibrates = False

    def declare(self, reason: str, up_to: float) -> None:
        """A declared wait begins: this rank is busy outside the collectives for good reason, for up to `up_to`
        seconds. Nested declarations count until the latest of their ends, under the innermost reason."""
        with self._lock:
            self._declared.append((reason, time.monotonic() + up_to))
            self._show_declared()

    def end_declared(self) -> None:
        """The innermost declared wait ended; when it was the last, the busy stretch begins again now."""
        with self._lock:
            self._declared.pop()
            if not self._declared and not self._depth and self._state[1]:
                self._state[1] = time.monotonic()
            self._show_declared()

    def excused(self) -> bool:
        """May the collective under way wait past the collective timeout (the agent says the rank it waits for is
        being judged)?"""
        (until,) = _EXCUSE.unpack_from(self._map, EXCUSE_OFFSET)
        return time.monotonic() < until

    def _show_declared(self) -> None:
        state = self._state
        if self._declared:
            state[7] = max(until for _, until in self._declared)
            state[8] = self._declared[-1][0].encode()[:REASON_BYTES]
        else:
            state[7], state[8] = 0.0, b""
        self._write()

    def _write(self) -> None:
        with self._lock:
            self._version += 1
            _VERSION.pack_into(self._map, 0, self._version)
            _BODY.pack_into(self._map, _VERSION.size, *self._state)
            self._version += 1
            _VERSION.pack_into(self._map, 0, self._version)


class NoRecord:
    """A worker that no agent started (or whose job measures no waits): waits are not recorded."""

    def begin_round(self, number: int) -> None:
        pass

    def __enter__(self) -> NoRecord:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def waiting(self, calibrates: bool = True) -> NoRecord:
        return self

    def discount(self) -> None:
        pass

    def declare(self, reason: str, up_to: float) -> None:
        pass

    def end_declared(self) -> None:
        pass

    def excused(self) -> bool:
        return False


def record_from_env() -> WaitRecord | NoRecord:
    """The record the agent made for this worker (`RECORD_ENV`), or NoRecord when there is none to write."""
    path = os.environ.get(RECORD_ENV)
    if not path:
        return NoRecord()
    try:
        return WaitRecord(path)
    except (OSError, ValueError):
        return NoRecord()


_stack_file: list[IO[str]] = []


def answer_stack_dumps() -> None:
    """Register every thread's Python stack to be written to the file `STACK_ENV` names on STACK_DUMP_SIGNAL
    (again after a fork: the file is this process's own)."""
    path = os.environ.get(STACK_ENV)
    if not path:
        return
    try:
        stack_file = open(path, "a")  # noqa: SIM115 - kept open for the signal handler, as faulthandler requires
    except OSError:
        return
    faulthandler.register(STACK_DUMP_SIGNAL, file=stack_file, all_threads=True, chain=False)
    for old in _stack_file:
        old.close()
    _stack_file[:] = [stack_file]
