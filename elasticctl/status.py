"""`elasticctl status`: one view of the job, its hosts and its workers, as a table or stable JSON; with the hang limits
the agents are told, the ranks suspected of hanging, the ranks stopped inside a collective, the waits ranks declared,
and the ranks the others waited for most (the registry's `waits`); replicated, the control hosts
(elasticctl/control_hosts.py) with etcd's database size; the job's goodput (services/registry/ledger.py: the share of
its wall clock spent training, and the three causes that cost most); each host's record (its failures, the last
reason, what holds it back and when it is checked next: `next_check_in`); the hosts a requeued Slurm job runs
without, with why (slurm/exclusions.py)."""

from __future__ import annotations

import json
import time
from typing import Any

from elastic_control_plane.elasticctl.control import ControlPlane
from elastic_control_plane.slurm.exclusions import describe


def gather(plane: ControlPlane) -> dict[str, Any]:
    job = plane.call("registry", "status")
    hosts = plane.call("discovery", "hosts")
    busy = {w["host"] for w in job.get("workers", []) if w["state"] in ("PENDING", "RUNNING", "READY")}
    declared = set(hosts.get("lost_declared") or [])  # lost on Slurm's word (its node DOWN), not for its silence
    rows = []
    for host in hosts["all"]:
        state = host["state"]
        if state == "draining" and host["host"] not in busy:
            state = "drained"
        row = {**host, "state": state, "next_check_in": next_check_in(host, time.time())}
        rows.append({**row, "lost_declared": host["host"] in declared})
    workers = job.pop("workers", [])
    history = job.pop("history", [])
    waits = job.pop("waits", None)
    excluded = hosts.get("excluded") or []
    quota = job.pop("quota_refused", None) or {}
    return {
        "job": job,
        "hosts": rows,
        "workers": workers,
        "history": history,
        "waits": waits,
        "excluded": excluded,
        "quota_refused": quota,
    }


def next_check_in(host: dict[str, Any], now: float) -> float | None:
    """Seconds until the host is checked for (re)admission: its cooldown's end, its agent's next health check while
    the last one failed, 0 while a recheck is asked (at its next heartbeat); None when nothing holds it back."""
    if host.get("blacklisted"):
        return host.get("cooldown_left")
    health = host.get("health") or {}
    if not host.get("health_hold"):
        return None
    if health.get("next_check") is not None:
        return round(max(0.0, health["next_check"] - now), 1)
    return 0.0


def table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [headers] + [["-" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def render(view: dict[str, Any], now: float) -> str:
    """The view as a table; ages are counted to `now` (wall-clock seconds, read once by the caller)."""
    job = view["job"]
    lines = [
        f"job {job['job']}: {job['state']}, round {job['round']}, world size {job['size']}, resets {job['resets']}"
        + (f", exit code {job['exit_code']}" if job["exit_code"] is not None else "")
    ]
    if job.get("reason"):
        lines.append(f"  reason: {job['reason']}")
    goodput = job.get("goodput") or {}
    if goodput.get("training_share") is not None:
        lines.append(f"  {goodput['headline']} (elasticctl report {job['job']}: where the rest went)")
    spec = job.get("spec") or {}
    if "max_restarts" in spec:
        lines.append(f"  crashed workers: {crash_policy(spec['max_restarts'], spec['restart_window'])}")
    checkpoint = newest_checkpoint(view["hosts"])
    if checkpoint is not None:
        lines.append(
            f"  last durable checkpoint: commit {checkpoint['commit']}, {_size(checkpoint['bytes'])}, "
            f"{_age(checkpoint['written_at'], now)} ago, {checkpoint.get('path', '')}"
        )
    if job.get("resumed_from"):
        lines.append(f"  resumed from the snapshot of commit {job['resumed_from']} after every worker failed")
    waits = view.get("waits") or {}
    if waits.get("limit_s") is not None:
        lines.append(f"  hang limit: {hang_limit(waits['limit_s'], waits.get('kill_s'), waits['upper_s'])}")
    lines += [f"  excluded from this allocation: {describe(entry)}" for entry in view.get("excluded") or []]
    lines += [
        f"  {host}: {keys} key(s) refused past a round's quota (its workers set keys the job does not use)"
        for host, keys in (view.get("quota_refused") or {}).items()
    ]
    lines.append("")
    host_rows = []
    for h in view["hosts"]:
        note = ""
        if h["state"] == "blacklisted":
            left = "forever" if h["cooldown_left"] is None else f"{h['cooldown_left']:.0f}s left"
            note = f"{h['blacklist_reason']} (cooldown {left}, then a health check)"
        elif h["state"] == "unhealthy":
            when = h.get("next_check_in")
            note = h["health_hold"] + ("" if when is None else f" (next check in {when:.0f}s)")
        elif h["state"] == "lost":
            gone = (
                "its node is down (Slurm), lost {:.1f}s ago" if h.get("lost_declared") else "no heartbeat for {:.1f}s"
            )
            note = gone.format(h["lost_for"]) + (
                f"; blacklisted after {h['blacklist_reason']}" if h["blacklisted"] else ""
            )
        if h.get("down"):
            restarting = f"slot {', '.join(map(str, h['down']))} restarting after a crash"
            note = f"{note}; {restarting}" if note else restarting
        fork_server = h.get("fork_server") or {}
        if fork_server.get("reason"):
            spawning = f"workers spawn: {fork_server['reason']}"
            note = f"{note}; {spawning}" if note else spawning
        snapshot = h.get("snapshot")
        held = (
            f"commit {snapshot['commit']}, {_size(snapshot['bytes'])}, {_age(snapshot['written_at'], now)} ago"
            if snapshot
            else None
        )
        if h.get("blacklist_count") and h["state"] not in ("blacklisted", "lost"):
            failed = f"last failure: {h['blacklist_reason']}"
            note = f"{note}; {failed}" if note else failed
        failures = h.get("blacklist_count", 0)
        host_rows.append([h["host"], h["slots"], h["state"], fork_server.get("state"), held, failures, note])
    headers = ["HOST", "SLOTS", "STATE", "FORK SERVER", "SNAPSHOT", "FAILURES", "NOTE"]
    lines += table(headers, host_rows) if host_rows else ["no hosts"]
    lines.append("")
    worker_rows = [
        [w["host"], w["local_rank"], w["rank"], w["state"], w["pid"], w["exit_code"], w["reason"]]
        for w in view["workers"]
    ]
    lines += (
        table(["HOST", "LOCAL", "RANK", "STATE", "PID", "EXIT", "NOTE"], worker_rows) if worker_rows else ["no workers"]
    )
    suspected = [
        [r["host"], r["local_rank"], r["rank"], r["pid"], r["stalled_s"], r["kill_at_s"]]
        for r in waits.get("suspected", [])
    ]
    if suspected:
        lines += ["", "suspected of hanging (no progress in its process tree; its stack is in the job's output):"]
        lines += table(["HOST", "LOCAL", "RANK", "PID", "NO PROGRESS S", "KILLED AT S"], suspected)
    stopped = [[r["host"], r["local_rank"], r["rank"], r["stopped_s"]] for r in waits.get("stopped", [])]
    if stopped:
        lines += ["", "stopped inside a collective (by a signal or a debugger; the others wait for it):"]
        lines += table(["HOST", "LOCAL", "RANK", "STOPPED S"], stopped)
    declared = [[r["host"], r["local_rank"], r["rank"], r["reason"], r["left_s"]] for r in waits.get("declared", [])]
    if declared:
        lines += ["", "declared waits (no hang judged while they last):"]
        lines += table(["HOST", "LOCAL", "RANK", "REASON", "LEFT S"], declared)
    slowest = [
        [r["host"], r["local_rank"], r["rank"], r["lost_s_per_min"], r["lost_s"]] for r in waits.get("ranks", [])
    ]
    if slowest:
        lines += ["", "slowest ranks (seconds the others waited for each):"]
        lines += table(["HOST", "LOCAL", "RANK", "LOST S/MIN", "LOST S"], slowest)
    if view["history"]:
        lines += ["", "recent rounds:"] + [
            f"  round {h['round']}: {h['action']} ({h['reason'] or 'hosts changed'})" for h in view["history"][-5:]
        ]
    if view.get("control_hosts"):
        lines += ["", render_control_plane(view)]
    return "\n".join(lines)


def render_control_plane(view: dict[str, Any]) -> str:
    """A replicated control plane as etcd sees it: its control hosts, and the records that keep a service from
    starting."""
    lines = render_control_hosts(view["control_hosts"])
    for record in view.get("corrupt_records") or []:
        lines.append(
            f"  {record['service']} cannot start: its record {record['key']} cannot be read ({record['reason']}); "
            "repair or delete the key"
        )
    return "\n".join(lines)


def render_control_hosts(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["control hosts:"]
    for row in rows:
        etcd = row["etcd"]
        if etcd is None:
            member = "no etcd member"
        elif not etcd["healthy"]:
            member = "etcd DOWN" + (f" ({etcd['error']})" if etcd.get("error") else "")
        else:
            member = "etcd leader" if etcd.get("leader") else "etcd follower"
            if etcd.get("db_size") is not None:
                member += f", database {_size(etcd['db_size'])} ({_size(etcd.get('db_size_in_use') or 0)} in use)"
        replicas = ", ".join(
            f"{service} {replica['role']} (pid {replica['pid']})"
            for service, replica in sorted(row["replicas"].items())
        )
        lines.append(f"  {row['host']}: {member}; {replicas or 'no replicas'}")
    return lines


def hang_limit(limit: float, kill: float | None, upper: float) -> str:
    """The limits in words: suspected at `limit` and killed at `kill` without progress; killed at `upper` busy."""
    if limit >= upper:
        return f"{upper:g}s (the upper bound: the job's hung timeout)"
    killed = "" if kill is None else f", killed at {kill:.1f}s"
    return f"suspected at {limit:.1f}s without progress{killed} (calibrated; upper bound {upper:g}s)"


def newest_checkpoint(hosts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The job's last durable checkpoint: the newest any host's agent wrote."""
    return max(
        (h["checkpoint"] for h in hosts if h.get("checkpoint")),
        key=lambda c: (c["commit"], c["written_at"]),
        default=None,
    )


def _size(nbytes: int) -> str:
    power = min(3, max(0, (nbytes.bit_length() - 1) // 10))
    return f"{nbytes} B" if power == 0 else f"{nbytes / 1024**power:.1f} {('KiB', 'MiB', 'GiB')[power - 1]}"


def _age(written_at: float, now: float) -> str:
    return f"{max(0.0, now - written_at):.1f}s"


def crash_policy(max_restarts: int, window: float) -> str:
    if max_restarts == 0:
        return "the first crash blacklists the host (--max-restarts 0)"
    return f"restarted in place, up to {max_restarts} times in {window:g}s per slot; then the host is blacklisted"


def as_json(view: dict[str, Any]) -> str:
    return json.dumps(view, indent=2, sort_keys=True)
