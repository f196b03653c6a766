"""PrefixedPipe: worker output copied line by line with its origin, partial lines held until complete."""

from __future__ import annotations

import io
import os

from elastic_control_plane.agent.output import PrefixedPipe


def test_lines_are_prefixed_and_partial_lines_wait_for_their_end() -> None:
    read_fd, write_fd = os.pipe()
    sink = io.BytesIO()
    pipe = PrefixedPipe(read_fd, "[h:0] ", sink)
    os.write(write_fd, b"first\nsec")
    assert pipe.pump()
    assert sink.getvalue() == b"[h:0] first\n"
    os.write(write_fd, b"ond\nthird")
    assert pipe.pump()
    os.close(write_fd)
    assert not pipe.pump(), "EOF ends the pipe"
    assert sink.getvalue() == b"[h:0] first\n[h:0] second\n[h:0] third\n"
