"""`elasticctl report JOB [--json]`: the job's goodput ledger (services/registry/ledger.py) as the registry keeps it:
every bucket of its wall clock with its share, how far below the size asked it trained, the seconds each cause and
each host cost, and the interruptions kept (the last 100), one line each. The registry keeps the ledger of its
current (or last) job only; asked for another, the command says so."""

from __future__ import annotations

import json
import time
from typing import Any

from elastic_control_plane.elasticctl.control import CommandError, ControlPlane
from elastic_control_plane.elasticctl.status import table
from elastic_control_plane.services.registry.goodput import headline
from elastic_control_plane.services.registry.ledger import BELOW_SIZE, BUCKETS, TIMELINE_KEPT

COLUMNS = ("detecting", "reforming", "waiting_for_hosts", "paused", "lost_work")


def gather(plane: ControlPlane, job_id: int) -> dict[str, Any]:
    reply = plane.call("registry", "ledger")
    if reply["job"] != job_id:
        held = f"job {reply['job']}" if reply["job"] else "no job"
        raise CommandError(f"the registry holds {held}, not job {job_id}: it keeps the ledger of its last job only")
    return reply


def render(reply: dict[str, Any]) -> str:
    goodput = reply["goodput"]
    wall = goodput["wall_s"]
    lines = [f"job {reply['job']} ({reply['state']}): {headline(goodput)}", "", "where the time went:"]
    for bucket in BUCKETS:
        seconds = goodput["buckets"][bucket]
        share = f"{seconds / wall:6.1%}" if wall > 0 else "     -"
        note, below = "", goodput["below_size"]
        if bucket == BELOW_SIZE and seconds > 0:
            short = f"{below['mean_short']:g} slot(s) short of {goodput['asked']} on average"
            note = f"  ({short}, at most {below['most_short']})"
        lines.append(f"  {bucket:<20} {seconds:10.1f}s {share}{note}")
    if not goodput["commits_seen"]:
        lines.append("  (no commits reported: lost work is not counted; see docs/operations.md)")
    causes = [(cause, s) for cause, s in goodput["causes"].items() if s > 0]
    lines += ["", "by cause:"] + ([f"  {cause:<12} {s:10.1f}s" for cause, s in causes] or ["  none"])
    hosts = list(goodput["hosts"].items())
    lines += ["", "by host:"] + ([f"  {host:<20} {s:10.1f}s" for host, s in hosts] or ["  none"])
    interruptions = goodput["interruptions"]
    lines += ["", f"interruptions (the last {TIMELINE_KEPT} are kept):"]
    rows = [
        [
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(entry["at"])) if entry["at"] else "-",
            entry["cause"],
            entry["host"] or "-",
            *(f"{entry[column]:.1f}" for column in COLUMNS),
            entry["rolled_back_to"],
            entry["reason"],
        ]
        for entry in interruptions
    ]
    headers = ["AT", "CAUSE", "HOST", "DETECT S", "REFORM S", "WAIT S", "PAUSED S", "LOST S", "TO COMMIT", "REASON"]
    lines += ["  " + line for line in table(headers, rows)] if rows else ["  none"]
    return "\n".join(lines)


def as_json(reply: dict[str, Any]) -> str:
    return json.dumps(reply, indent=2, sort_keys=True)
