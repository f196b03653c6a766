"""The hosts a requeued job runs without, and why: at a requeue the driver (slurm/batch.py) records the hosts the
job gave up on (blacklisted) in STATE/JOB/exclude, Slurm's ExcNodeList (the batch script reads it), and in
STATE/JOB/exclude.json, each with the requeue before which it was given up on and why it was blacklisted; the
rerun's driver hands the latter to the discovery it starts (ELASTIC_SLURM_EXCLUDED), which checks it here and lists
it in its `hosts` reply (`excluded`) for `elasticctl status`. Pure but for the files' reading and writing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SLURM_LIST, WHY = "exclude", "exclude.json"  # under STATE/JOB/


def checked(text: str) -> list[dict[str, Any]]:
    """The excluded hosts of `text` (JSON: [{host, requeue, reason}]); ValueError saying what is wrong."""
    try:
        entries = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(entries, list):
        raise ValueError("not a list of {host, requeue, reason}")
    for entry in entries:
        if not (isinstance(entry, dict) and set(entry) == {"host", "requeue", "reason"}):
            raise ValueError(f"{entry!r}: not {{host, requeue, reason}}")
        host, requeue, reason = entry["host"], entry["requeue"], entry["reason"]
        if not isinstance(host, str) or not host or any(c.isspace() or c == "," for c in host):
            raise ValueError(f"{entry!r}: host must be a node name")
        if isinstance(requeue, bool) or not isinstance(requeue, int) or requeue < 1:
            raise ValueError(f"{entry!r}: requeue must be a whole number from 1")
        if not isinstance(reason, str):
            raise ValueError(f"{entry!r}: reason must be a string")
    return entries


def merged(before: list[dict[str, Any]], hosts_reply: dict[str, Any], requeue: int) -> list[dict[str, Any]]:
    """The hosts excluded from requeue `requeue` on: those of earlier requeues, then the hosts discovery's `hosts`
    reply lists as blacklisted (for good or for a cooldown: a requeued job's new control plane would not know)."""
    known = {entry["host"] for entry in before}
    given_up = [row for row in hosts_reply.get("all") or [] if row.get("blacklisted") and row["host"] not in known]
    return before + [
        {"host": row["host"], "requeue": requeue, "reason": row.get("blacklist_reason") or ""} for row in given_up
    ]


def load(job_dir: Path) -> list[dict[str, Any]]:
    """STATE/JOB/exclude.json's hosts ([] without the file); ValueError when it cannot be read."""
    try:
        return checked((job_dir / WHY).read_text())
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise ValueError(str(exc)) from None


def save(job_dir: Path, excluded: list[dict[str, Any]]) -> None:
    """Both files: Slurm's list (`node2,node3`) and the hosts with why."""
    (job_dir / WHY).write_text(json.dumps(excluded) + "\n")
    (job_dir / SLURM_LIST).write_text(",".join(entry["host"] for entry in excluded) + "\n")


def describe(entry: dict[str, Any]) -> str:
    """`node2 (the job gave up on it before requeue 1: REASON)`, as `elasticctl status` says it."""
    why = f": {entry['reason']}" if entry.get("reason") else ""
    return f"{entry['host']} (the job gave up on it before requeue {entry['requeue']}{why})"
