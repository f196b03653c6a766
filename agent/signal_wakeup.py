"""SignalWakeup: signals wake the agent's loop through a pipe (the wakeup fd) and are handled there, never in a handler.

Python's handlers for the signals the agent catches do nothing; the
interpreter writes each signal's number to the pipe, whose read end the loop
watches; `received` drains it.
"""

from __future__ import annotations

import os
import signal


class SignalWakeup:
    def __init__(self, signals: tuple[int, ...]) -> None:
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        for signum in signals:
            signal.signal(signum, lambda *_: None)

    def received(self) -> bytes:
        """The numbers of the signals received since the last call, one byte each."""
        received = b""
        try:
            while chunk := os.read(self.read_fd, 512):
                received += chunk
        except BlockingIOError:
            pass
        return received

    def close(self) -> None:
        signal.set_wakeup_fd(-1)
        for fd in (self.read_fd, self.write_fd):
            os.close(fd)
