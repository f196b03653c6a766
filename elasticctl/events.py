"""`elasticctl events`: the notifier's event stream, one line per event, from its history and, with --follow, live.

A line is `TIME seq=N TYPE key=value ...`. TIME is when the event happened: the notifier's `time` stamp or the event's
own `timestamp`; an event seen live without either gets the time it arrived, one from history without either gets
`????-??-?? ??:??:??.???` (same width). Then the fields that say what happened: plumbing (incarnation, publish key,
command, environment, job key) is left out, lists longer than LIST_ITEMS are cut with `...+N`, and a value with spaces
is quoted. Heartbeats are not printed. `--follow` delivers through `bus.pubsub.Subscription` (ordered, gap-free,
across a notifier restart) and rides through notifier outages with one line when the notifier goes and one when it is
back.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from datetime import datetime
from typing import Any, TextIO

from elastic_control_plane.bus.contract import PUBLISH_KEY, Event
from elastic_control_plane.bus.pubsub import HEARTBEAT
from elastic_control_plane.elasticctl.control import ControlPlane, ControlPlaneUnreachable
from elastic_control_plane.elasticctl.outage import Outage

LIST_ITEMS = 4
TEXT_CHARS = 60
SILENCE = 2.0  # seconds without a heartbeat or an event before the notifier is asked whether it is there
NO_TIME = "????-??-?? ??:??:??.???"  # same width and number of words as a time

# The fields shown per event type, in order; an event type not listed shows every field but the hidden ones.
FIELDS = {
    Event.ABORT: ["round"],
    Event.KILL_WORKER: ["host", "local_rank", "pid"],
    Event.WORKER_SUSPECTED: ["host", "local_rank", "rank", "reason"],
    Event.WORKER_HUNG: ["host", "local_rank", "rank", "reason"],
    Event.STRAGGLER: ["host", "local_rank", "rank", "lost_s_per_min"],
    Event.JOB_FINISHED: ["job", "state", "exit_code", "reason"],
}
HIDDEN = {"seq", "incarnation", "time", "timestamp", PUBLISH_KEY}


def event_line(event_type: str, body: dict[str, Any], arrived_at: float | None) -> str:
    """One event as one line; `arrived_at` is when it was seen live (None for history)."""
    when = _event_time(body, arrived_at)
    stamp = NO_TIME if when is None else datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    fields = " ".join(f"{name}={format_value(value)}" for name, value in _fields(event_type, body))
    return f"{stamp} seq={body.get('seq')} {event_type}" + (f" {fields}" if fields else "")


def _event_time(body: dict[str, Any], arrived_at: float | None) -> float | None:
    for name in ("time", "timestamp"):
        value = body.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return arrived_at


def _fields(event_type: str, body: dict[str, Any]) -> list[tuple[str, Any]]:
    if event_type == Event.ROUND:
        hosts = [f"{name}:{len(ids)}" for name, ids in body.get("hosts") or []]
        return [("round", body.get("round")), ("size", body.get("size")), ("hosts", hosts), ("job", body.get("job"))]
    if event_type == Event.HOSTS_UPDATED:
        if "hosts" in body:
            hosts = [
                f"{name}:{len(slots) if isinstance(slots, list) else slots}" for name, slots in body.get("hosts") or []
            ]
            return [("added", body.get("added")), ("removed", body.get("removed")), ("hosts", hosts)]
        changed = [
            f"+{name}:{len(slots) if isinstance(slots, list) else slots}" for name, slots in body.get("set") or []
        ]
        return [
            ("added", body.get("added")),
            ("removed", body.get("removed")),
            ("changed", changed + [f"-{name}" for name in body.get("remove") or []]),
        ]
    names = FIELDS.get(event_type) or sorted(name for name in body if name not in HIDDEN)
    return [(name, body.get(name)) for name in names]


def format_value(value: Any) -> str:
    """A value as one token: `-` for nothing, lists comma-joined and cut after LIST_ITEMS, text with spaces quoted."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        if not value:
            return "-"
        shown = ",".join(format_value(item) for item in value[:LIST_ITEMS])
        return shown + (f",...+{len(value) - LIST_ITEMS}" if len(value) > LIST_ITEMS else "")
    if isinstance(value, dict):
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 3] + "..."
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


def print_history(plane: ControlPlane, since: int, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Print the events after `since` that the notifier still holds; return its reply (incarnation, latest)."""
    reply = plane.call("notifier", "since", {"seq": since})
    events = [(event_type, body) for event_type, body in reply["events"] if event_type != HEARTBEAT]
    if events and events[0][1]["seq"] > since + 1:
        sys.stderr.write(f"[elasticctl] the notifier no longer holds events {since + 1}..{events[0][1]['seq'] - 1}\n")
    for event_type, body in events:
        out.write(event_line(event_type, body, None) + "\n")
    out.flush()
    return reply


def follow_events(plane: ControlPlane, since: int, out: TextIO = sys.stdout) -> int:
    """Print the history after `since`, then every new event until Ctrl-C; return 0."""
    subscription = plane.subscription()  # subscribed before the history is read: nothing falls between the two
    outage = Outage(lambda line: print(line, file=sys.stderr, flush=True))
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reply = print_history(plane, since, out)
        subscription.incarnation = reply["incarnation"]
        subscription.last_seq = max(since, int(reply["latest"]))
        heard_at = time.monotonic()
        ask_at = heard_at + SILENCE
        while True:
            if not subscription.sock.poll(max(0, int((ask_at - time.monotonic()) * 1000))):
                try:
                    plane.call("notifier", "ping")
                except ControlPlaneUnreachable as exc:
                    ask_at = time.monotonic() + outage.failed(exc, silent_since=heard_at)
                    continue
            outage.answered()
            heard_at = time.monotonic()
            ask_at = heard_at + SILENCE
            for event in subscription.receive():
                out.write(event_line(event.type, event.body, time.time()) + "\n")
            out.flush()
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGINT, previous)
        subscription.close()
