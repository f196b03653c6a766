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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pipe_and_writer(clock: Clock | None = None) -> tuple[PrefixedPipe, int, io.BytesIO]:
    read_fd, write_fd = os.pipe()
    sink = io.BytesIO()
    return PrefixedPipe(read_fd, "[h:0] ", sink, clock or Clock()), write_fd, sink


def test_a_progress_bar_that_redraws_with_carriage_returns_is_shown_live_in_place_and_prefixed() -> None:
    pipe, writer, sink = pipe_and_writer()
    for update in (b"\r  0%|", b"\r 50%|#####", b"\r100%|##########"):
        os.write(writer, update)
        assert pipe.pump()
    assert sink.getvalue() == b"[h:0]   0%|\r[h:0]  50%|#####\r", "each redraw is written once the next one begins"
    os.write(writer, b"\ndone\r\nnext\r")
    assert pipe.pump()
    assert sink.getvalue().endswith(b"[h:0] 100%|##########\n[h:0] done\r\n"), "\\r\\n is one end"
    os.write(writer, b"\n")
    assert pipe.pump()
    assert sink.getvalue().endswith(b"[h:0] next\r\n"), "a \\r at the end of a read waits for a \\n"
    os.close(writer)
    assert not pipe.pump()


def test_a_partial_line_is_written_after_a_second_and_the_agent_never_holds_more_than_64_kib() -> None:
    clock = Clock()
    pipe, writer, sink = pipe_and_writer(clock)
    os.write(writer, b"loading...")
    assert pipe.pump()
    clock.now = 0.9
    pipe.flush_stale()
    assert sink.getvalue() == b""
    clock.now = 1.0
    pipe.flush_stale()
    assert sink.getvalue() == b"[h:0] loading...\n"
    endless = b"x" * 200_000
    for start in (0, 32768, 65536, 98304):
        os.write(writer, endless[start : start + 32768])
        assert pipe.pump()
    assert len(pipe.partial) < 64 * 1024, "a line with no end in sight is written as it comes"
    os.close(writer)
    assert not pipe.pump()
    assert sink.getvalue().replace(b"[h:0] ", b"").replace(b"\n", b"") == b"loading..." + endless[:131072]
