"""Worker output: each line a worker writes to stdout/stderr is written by the agent with a `[host:local_rank]` prefix.

Four workers on one terminal stay readable (a traceback is not interleaved
mid-line with another's), and every line says where it came from. Partial
lines wait for their end; what is left is written when the pipe closes.
"""

from __future__ import annotations

import os
from typing import BinaryIO


class PrefixedPipe:
    """The read end of one worker stream, copied line by line to `sink` with a prefix."""

    def __init__(self, fd: int, prefix: str, sink: BinaryIO) -> None:
        self.fd = fd
        self.prefix = prefix.encode()
        self.sink = sink
        self.partial = b""
        os.set_blocking(fd, False)

    def pump(self) -> bool:
        """Copy what is readable now; False once the writer has closed the pipe (then the fd is closed)."""
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                self._write(self.partial + b"\n" if self.partial else b"")
                os.close(self.fd)
                return False
            *lines, self.partial = (self.partial + chunk).split(b"\n")
            self._write(b"".join(line + b"\n" for line in lines))

    def _write(self, data: bytes) -> None:
        if not data:
            return
        self.sink.write(b"".join(self.prefix + line for line in data.splitlines(keepends=True)))
        self.sink.flush()
