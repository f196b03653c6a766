"""The registry's side of discovery: what it tells discovery of a job, and what it reads in discovery's answers.

Discovery's `hosts` answer (services/discovery/service.py) carries the
`available` hosts with their usable slot ids, the `lost` ones, the host set's
`timestamp` and discovery's `incarnation`; the brief one adds the live
`agents` with their incarnations and the `marked` hosts (drains, blacklists).
Its `snapshots` answer has the commit of each live host's snapshot and
whether any host is usable. Every function here is pure: it reads a map and
returns plain values.
"""

from __future__ import annotations

from typing import Any

from elastic_control_plane.job.spec import JobSpec


def discovery_settings(spec: JobSpec) -> dict[str, Any]:
    """What discovery is told of a job, at its submission and when a restarted discovery is restored."""
    return {
        "max_np": spec.max_np,
        "discovery_script": spec.discovery_script,
        "cooldown": list(spec.cooldown) if spec.cooldown else None,
        "probation_clean": spec.probation_clean,
    }


def available_slots(hosts: dict[str, Any]) -> int:
    """The slots of the available hosts (a host is given as its slot count or as the ids of its usable slots)."""
    return sum(len(slots) if isinstance(slots, list) else slots for _, slots in hosts.get("available", []))


def agent_incarnations(hosts: dict[str, Any]) -> dict[str, str]:
    """Each live agent's incarnation: one that changed since the round began restarted, and its workers died."""
    agents = hosts.get("agents", {})
    return {host: incarnation for host, incarnation in agents.items() if isinstance(incarnation, str)}


def restarted_agents(hosts: dict[str, Any], agents: dict[str, str]) -> set[str]:
    """The hosts whose agent's incarnation is not the one in `agents` (host: incarnation when the round began).
    Read on every pass: the live agents that differ are found by a set difference (no step per host in Python)."""
    live = hosts.get("agents", {})
    try:
        differ = live.items() - agents.items()
    except TypeError:  # an incarnation that cannot be hashed (discovery sends strings)
        differ = set(agent_incarnations(hosts).items()) - agents.items()
    return {host for host, incarnation in differ if isinstance(incarnation, str)}


def newest_snapshot(snapshots: dict[str, Any], exit_reports: dict[str, int]) -> int:
    """The newest commit held in a snapshot that an agent keeps now (`snapshots`: discovery's answer, the commit of
    each host that is not lost and whose agent reports one: an agent that restarted starts with an empty snapshot).
    A host's `exit_reports` (host: the newest commit a worker's exit report named) may be newer than its last
    heartbeat."""
    newest = 0
    for host, commit in snapshots.get("commits", {}).items():
        if isinstance(commit, int) and commit > 0:
            newest = max(newest, commit, exit_reports.get(host, 0))
    return newest


def host_marks(hosts: dict[str, Any], known: dict[str, dict[str, Any]], wall_now: float) -> dict[str, dict[str, Any]]:
    """What discovery holds against hosts (drains, blacklists with their count and end in wall-clock seconds), to
    give a restarted discovery; a blacklist already `known` keeps its end, so an unchanged one is not saved again."""
    marks = {}
    for row in hosts.get("marked", []):
        before = known.get(row["host"], {})
        until = None
        if row.get("blacklisted") and row.get("cooldown_left") is not None:
            same = (
                before.get("blacklisted")
                and before.get("count") == row.get("blacklist_count")
                and before.get("until") is not None
            )
            until = before["until"] if same else round(wall_now + row["cooldown_left"], 3)
        marks[row["host"]] = {
            "draining": bool(row.get("draining")),
            "blacklisted": bool(row.get("blacklisted")),
            "until": until,
            "count": int(row.get("blacklist_count") or 0),
            "reason": str(row.get("blacklist_reason") or ""),
        }
    return marks
