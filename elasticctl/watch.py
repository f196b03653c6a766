"""`elasticctl status --watch`: the status view redrawn every interval until Ctrl-C, through control-plane outages.

On a terminal each frame replaces the previous one in place (ANSI: cursor home, erase what is left); elsewhere
each frame is printed followed by a blank line. With `--json`, each interval prints the view as one JSON document
on one line, and the outage lines go to stderr so stdout stays parseable. The first request must be answered (a
wrong --control is one error line); later outages show "control plane unreachable, retrying" and the watch goes on.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from datetime import datetime
from typing import Any, TextIO

from elastic_control_plane.elasticctl.control import ControlPlane, ControlPlaneUnreachable
from elastic_control_plane.elasticctl.outage import UNREACHABLE, Outage
from elastic_control_plane.elasticctl.status import gather, render

HOME = "\x1b[H"
ERASE_LINE_END = "\x1b[K"
ERASE_BELOW = "\x1b[J"


def frame_header(interval: float, now: float) -> str:
    return f"{datetime.fromtimestamp(now):%Y-%m-%d %H:%M:%S}  elasticctl status, every {interval:g}s"


def redraw_in_place(text: str) -> str:
    """What to write to a terminal to replace the screen with `text`, without clearing it first (no flicker)."""
    return HOME + "".join(line + ERASE_LINE_END + "\n" for line in text.split("\n")) + ERASE_BELOW


def watch_status(
    plane: ControlPlane, interval: float, as_json_lines: bool, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    """Show the view every `interval` seconds until Ctrl-C; return 0."""
    on_terminal = out.isatty() and not as_json_lines

    def show(text: str) -> None:
        out.write(redraw_in_place(text) if on_terminal else text + ("\n" if as_json_lines else "\n\n"))
        out.flush()

    def note(line: str) -> None:
        if as_json_lines:
            err.write(line + "\n")
            err.flush()
        elif not on_terminal:
            show(line)

    outage = Outage(note)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        view: dict[str, Any] | None = gather(plane)
        next_frame = time.monotonic()
        while True:
            now = time.time()
            if view is not None:
                show(
                    json.dumps(view, sort_keys=True)
                    if as_json_lines
                    else f"{frame_header(interval, now)}\n\n{render(view, now)}"
                )
            elif on_terminal:
                show(f"{frame_header(interval, now)}\n\n{UNREACHABLE} (for {outage.lasted():.0f}s)")
            next_frame = max(next_frame + interval, time.monotonic())
            time.sleep(max(0.0, next_frame - time.monotonic()))
            try:
                view = gather(plane)
            except ControlPlaneUnreachable as exc:
                outage.failed(exc)
                view = None
            else:
                outage.answered()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)
