"""What discovery reads in its requests' bodies, checked field by field: an agent's down slots, snapshot and
checkpoint, fork server, health and warmth; the registry's job settings, marks and expected hosts.

Every function takes a request's body (or one field of it) and returns plain
values, or raises `RequestError("bad_request", ...)` naming the field, so a
malformed request changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastic_control_plane.bus.service import RequestError, field
from elastic_control_plane.services.discovery.hostset import Mark, slot_ids
from elastic_control_plane.services.discovery.probation import DEFAULT_CLEAN_WINDOW

MAX_PATH = 4096
MAX_REASON = 500
FORK_SERVER_STATES = ("ready", "starting", "unavailable", "off")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def down_slots(body: dict[str, Any]) -> tuple[list[int], int]:
    """The agent's slots whose worker crashed and is not back yet, and the version of that list."""
    down = body.get("down")
    if not isinstance(down, list) or not all(_is_count(i) for i in down):
        raise RequestError("bad_request", "field 'down' must be a list of slot numbers")
    return down, field(body, "down_version", int)


def snapshots(body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The agent's report of its snapshot and last checkpoint."""
    found = {}
    for kind in ("snapshot", "checkpoint"):
        report = body.get(kind)
        if report is None:
            continue
        if not isinstance(report, dict):
            raise RequestError("bad_request", f"field {kind!r} must be a map")
        commit, size, written_at, path = (
            report.get("commit"),
            report.get("bytes"),
            report.get("written_at"),
            report.get("path", ""),
        )
        if not (_is_count(commit) and _is_count(size)):
            raise RequestError("bad_request", f"{kind}.commit and {kind}.bytes must be integers >= 0")
        if not isinstance(written_at, (int, float)) or isinstance(written_at, bool):
            raise RequestError("bad_request", f"{kind}.written_at must be a time in seconds")
        if not isinstance(path, str) or len(path) > MAX_PATH:
            raise RequestError("bad_request", f"{kind}.path must be a path of at most {MAX_PATH} characters")
        found[kind] = {
            "commit": commit,
            "bytes": size,
            "written_at": float(written_at),
            **({"path": path} if path else {}),
        }
    return found


def same_reports(
    body: dict[str, Any], snapshots: dict[str, dict[str, Any]], fork_server: dict[str, str] | None
) -> bool:
    """Whether the body repeats the snapshot, checkpoint and fork server reports kept for its host (checked when they
    were first sent): what most heartbeats do, and they need neither checking nor copying again."""
    return (
        body.get("snapshot") == snapshots.get("snapshot")
        and body.get("checkpoint") == snapshots.get("checkpoint")
        and body.get("fork_server") == fork_server
    )


def fork_server(body: dict[str, Any]) -> dict[str, str] | None:
    """The agent's report of its fork server (None from an agent that does not report one)."""
    report = body.get("fork_server")
    if report is None:
        return None
    if (
        not isinstance(report, dict)
        or report.get("state") not in FORK_SERVER_STATES
        or not isinstance(report.get("reason", ""), str)
    ):
        raise RequestError(
            "bad_request",
            f"field 'fork_server' must be a map with a state of {', '.join(FORK_SERVER_STATES)} and a reason",
        )
    return {"state": report["state"], "reason": report.get("reason", "")[:MAX_REASON]}


def _is_time(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def health(body: dict[str, Any]) -> dict[str, Any] | None:
    """The agent's last health check (None from an agent that does not report one): {ok, reason, checked_at (its
    wall-clock seconds; null while the first check runs), request (the recheck it answers), next_check (when it
    checks again by itself, or null)}."""
    report = body.get("health")
    if report is None:
        return None
    if not (
        isinstance(report, dict)
        and isinstance(report.get("ok"), bool)
        and isinstance(report.get("reason", ""), str)
        and (report.get("checked_at") is None or _is_time(report.get("checked_at")))
        and _is_count(report.get("request", 0))
        and (report.get("next_check") is None or _is_time(report.get("next_check")))
    ):
        raise RequestError(
            "bad_request", "field 'health' must be a map {ok: bool, reason, checked_at, request, next_check}"
        )
    checked = {
        "ok": report["ok"],
        "reason": report.get("reason", "")[:MAX_REASON],
        "checked_at": report.get("checked_at"),
        "request": report.get("request", 0),
        "next_check": report.get("next_check"),
    }
    return {**checked, "probe": probe(report["probe"])} if report.get("probe") is not None else checked


def probe(report: Any) -> dict[str, Any]:
    """The agent's collective probe (agent/collective_probe.py): {store (None while its process starts), id (the
    last probe's, or None), seconds, collective_s, error}."""
    if not isinstance(report, dict):
        raise RequestError(
            "bad_request", "field 'health.probe' must be a map {store, id, seconds, collective_s, error}"
        )
    store, probe_id, error = report.get("store"), report.get("id"), report.get("error")
    seconds, collective = report.get("seconds"), report.get("collective_s")
    if not (
        (store is None or isinstance(store, str) and 0 < len(store) <= MAX_PATH)
        and (probe_id is None or isinstance(probe_id, int) and not isinstance(probe_id, bool))
        and all(value is None or _is_time(value) and value >= 0 for value in (seconds, collective))
        and (error is None or isinstance(error, str))
    ):
        raise RequestError(
            "bad_request", "field 'health.probe' must be a map {store, id, seconds, collective_s, error}"
        )
    return {
        "store": store,
        "id": probe_id,
        "seconds": seconds,
        "collective_s": collective,
        "error": error[:MAX_REASON] if error else None,
    }


def warm(body: dict[str, Any]) -> bool:
    value = body.get("warm", True)
    if not isinstance(value, bool):
        raise RequestError("bad_request", "field 'warm' must be a bool")
    return value


@dataclass(frozen=True)
class Settings:
    """A job's settings for discovery (`configure`, `restore`)."""

    max_np: int | None
    discovery_script: str | None
    cooldown: tuple[float, float] | None
    probation_clean: float | None = DEFAULT_CLEAN_WINDOW  # null: a host's blacklist count is never forgotten


def settings(body: dict[str, Any]) -> Settings:
    max_np, script, cooldown = body.get("max_np"), body.get("discovery_script"), body.get("cooldown")
    clean = body.get("probation_clean", DEFAULT_CLEAN_WINDOW)
    if clean is not None and not (_is_time(clean) and clean >= 0):
        raise RequestError("bad_request", "probation_clean must be seconds >= 0 or null")
    if max_np is not None and not isinstance(max_np, int):
        raise RequestError("bad_request", "max_np must be an integer or null")
    if script is not None and not isinstance(script, str):
        raise RequestError("bad_request", "discovery_script must be a path or null")
    if cooldown is not None and not (
        isinstance(cooldown, list) and len(cooldown) == 2 and all(isinstance(c, (int, float)) for c in cooldown)
    ):
        raise RequestError("bad_request", "cooldown must be [min, max] seconds or null")
    return Settings(
        max_np,
        script,
        None if cooldown is None else (float(cooldown[0]), float(cooldown[1])),
        None if clean is None else float(clean),
    )


def marks(raw: Any, local_now: float, wall_now: float) -> dict[str, Mark]:
    """The registry's marks, with each blacklist's end turned from wall-clock time (`wall_now` now) into discovery's
    clock (`local_now` now)."""
    if not isinstance(raw, dict):
        raise RequestError("bad_request", "marks must map host names to marks")
    found = {}
    for host, mark in raw.items():
        until = mark.get("until") if isinstance(mark, dict) else None
        if not (
            isinstance(host, str)
            and isinstance(mark, dict)
            and isinstance(mark.get("draining"), bool)
            and isinstance(mark.get("blacklisted"), bool)
            and isinstance(mark.get("count"), int)
            and isinstance(mark.get("reason"), str)
            and (until is None or isinstance(until, (int, float)) and not isinstance(until, bool))
        ):
            raise RequestError(
                "bad_request", f"bad mark for {host!r}: want {{draining, blacklisted, until, count, reason}}"
            )
        local_until = float("inf") if until is None else local_now + (until - wall_now)
        found[host] = Mark(mark["draining"], mark["blacklisted"], local_until, mark["count"], mark["reason"])
    return found


def expected(raw: Any) -> list[tuple[str, tuple[int, ...]]]:
    """The hosts of the job's current round, [[host, [slot ids]]]."""
    if not isinstance(raw, list) or not all(
        isinstance(item, list)
        and len(item) == 2
        and isinstance(item[0], str)
        and isinstance(item[1], list)
        and all(_is_count(i) for i in item[1])
        for item in raw
    ):
        raise RequestError("bad_request", "expected must be a list of [host, [slot ids]]")
    return [(name, slot_ids(ids)) for name, ids in raw]
