"""Worker output: each line a worker writes to stdout/stderr is written by the agent with a `[host:local_rank]` prefix.

Four workers on one terminal stay readable (a traceback is not interleaved
mid-line with another's), and every line says where it came from. A line ends
at `\n`, `\r\n` or `\r`, and keeps its end: a progress bar that redraws itself
with `\r` (tqdm) is shown live, in place, prefixed. A partial line waits for
its end, but never past PARTIAL_MAX bytes or `partial_line_wait` seconds (agent/intervals.py; `flush_stale`,
from the agent's loop): then it is written as a line of its own, so the agent
holds a bounded amount of each worker's output and splits each byte once.
What is left is written when the pipe closes.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from typing import BinaryIO

from elastic_control_plane.agent.intervals import INTERVALS

PARTIAL_MAX = 64 * 1024
_LINE_END = re.compile(rb"\r\n|\n|\r")


class PrefixedPipe:
    """The read end of one worker stream, copied line by line to `sink` with a prefix."""

    def __init__(self, fd: int, prefix: str, sink: BinaryIO, clock: Callable[[], float] = time.monotonic) -> None:
        self.fd = fd
        self.prefix = prefix.encode()
        self.sink = sink
        self.clock = clock
        self.partial = b""
        self.partial_since = 0.0
        os.set_blocking(fd, False)

    def pump(self) -> bool:
        """Copy what is readable now; False once the writer has closed the pipe (then the fd is closed)."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                self._write_partial()
                os.close(self.fd)
                return False
            self._take(chunk)

    def flush_stale(self) -> None:
        """Write a partial line that has waited `partial_line_wait` seconds for its end."""
        if self.partial and self.clock() - self.partial_since >= INTERVALS.partial_line_wait:
            self._write_partial()

    def _take(self, chunk: bytes) -> None:
        """Write the complete lines of what was held and `chunk`; hold the rest (a `\r` at the very end too: a `\n`
        may follow in the next read). A bare `\r` (a bar about to redraw itself) writes nothing."""
        data = self.partial + chunk
        lines, start = [], 0
        for end in _LINE_END.finditer(data):
            lines.append(data[start : end.end()])
            start = end.end()
        if lines and data.endswith(b"\r"):
            lines.pop()
        if lines or not self.partial:
            self.partial_since = self.clock()  # the held part is a new line
        self.partial = data[sum(len(line) for line in lines) :]
        self._write([line for line in lines if line != b"\r"])
        if len(self.partial) >= PARTIAL_MAX:
            self._write_partial()

    def _write_partial(self) -> None:
        if self.partial:
            held, self.partial = self.partial, b""
            self._write([held if held.endswith((b"\n", b"\r")) else held + b"\n"])

    def _write(self, lines: list[bytes]) -> None:
        if lines:
            self.sink.write(b"".join(self.prefix + line for line in lines))
            self.sink.flush()
