"""`elasticctl status` as a table: each host's snapshot (commit, size, age) and the job's last durable checkpoint,
each host's fork server (why a host spawns its workers, in its note), the hang limit and the slowest ranks;
a host lost on Slurm's word."""

from __future__ import annotations

import time

from elastic_control_plane.elasticctl.status import next_check_in, render
from elastic_control_plane.services.registry.goodput import headline
from elastic_control_plane.services.registry.ledger import Ledger


def host(name: str, snapshot: dict | None, checkpoint: dict | None, fork_server: dict | None = None) -> dict:
    return {
        "host": name,
        "slots": 1,
        "state": "active",
        "down": [],
        "blacklisted": False,
        "snapshot": snapshot,
        "checkpoint": checkpoint,
        "fork_server": fork_server,
    }


def test_the_table_shows_each_hosts_snapshot_and_the_newest_durable_checkpoint() -> None:
    now = time.time()
    view = {
        "job": {
            "job": 1,
            "state": "running",
            "round": 2,
            "size": 2,
            "resets": 1,
            "exit_code": None,
            "reason": "",
            "spec": {},
            "resumed_from": 40,
        },
        "hosts": [
            host(
                "host-1",
                {"commit": 57, "bytes": 3 << 20, "written_at": now - 0.5},
                {
                    "commit": 50,
                    "bytes": 3 << 20,
                    "written_at": now - 4,
                    "path": "/ckpt/host-1/commit-000000000050.snap",
                },
            ),
            host(
                "host-2",
                None,
                {
                    "commit": 45,
                    "bytes": 3 << 20,
                    "written_at": now - 9,
                    "path": "/ckpt/host-2/commit-000000000045.snap",
                },
            ),
        ],
        "workers": [],
        "history": [],
    }
    text = render(view, now)
    assert "last durable checkpoint: commit 50, 3.0 MiB, 4." in text and "/ckpt/host-1/commit-000000000050.snap" in text
    assert "resumed from the snapshot of commit 40 after every worker failed" in text
    row = next(line for line in text.splitlines() if line.startswith("host-1"))
    assert "commit 57, 3.0 MiB, 0.5s ago" in row
    assert next(line for line in text.splitlines() if line.startswith("host-2")).split()[3:5] == ["-", "-"], (
        "no fork server reported, no snapshot"
    )


def test_the_table_shows_each_hosts_fork_server_and_why_a_host_spawns() -> None:
    why = "the fork server exited with code 1: ModuleNotFoundError: No module named 'torch'"
    view = {
        "job": {
            "job": 1,
            "state": "running",
            "round": 1,
            "size": 3,
            "resets": 0,
            "exit_code": None,
            "reason": "",
            "spec": {},
        },
        "hosts": [
            host("host-1", None, None, {"state": "ready", "reason": ""}),
            host("host-2", None, None, {"state": "unavailable", "reason": why}),
            host("host-3", None, None, {"state": "starting", "reason": ""}),
        ],
        "workers": [],
        "history": [],
    }
    rows = {line.split()[0]: line for line in render(view, 0.0).splitlines() if line.strip()}
    assert rows["HOST"].split()[:5] == ["HOST", "SLOTS", "STATE", "FORK", "SERVER"]
    assert rows["host-1"].split()[3] == "ready" and "workers spawn" not in rows["host-1"]
    assert rows["host-2"].split()[3] == "unavailable" and rows["host-2"].endswith(f"workers spawn: {why}")
    assert rows["host-3"].split()[3] == "starting"


def waits_view(waits: dict | None) -> dict:
    job = {
        "job": 1,
        "state": "running",
        "round": 1,
        "size": 4,
        "resets": 0,
        "exit_code": None,
        "reason": "",
        "spec": {},
    }
    return {"job": job, "hosts": [], "workers": [], "history": [], "waits": waits}


def test_the_table_shows_the_hang_limits_the_suspects_the_stopped_the_declared_waits_and_the_costliest_ranks() -> None:
    ranks = [
        {"host": "host-2", "local_rank": 1, "rank": 3, "lost_s_per_min": 10.2, "lost_s": 412.5},
        {"host": "host-1", "local_rank": 0, "rank": 0, "lost_s_per_min": 0.6, "lost_s": 3.1},
    ]
    suspected = [{"host": "host-3", "local_rank": 0, "rank": 2, "pid": 4242, "stalled_s": 31.2, "kill_at_s": 40.0}]
    declared = [{"host": "host-1", "local_rank": 1, "rank": 1, "reason": "fetching shard 7", "left_s": 512.3}]
    waits = {"limit_s": 30.0, "kill_s": 40.0, "upper_s": 120.0, "ranks": ranks}
    stopped = [{"host": "host-2", "local_rank": 0, "rank": 2, "stopped_s": 6.4}]
    lines = render(
        waits_view({**waits, "suspected": suspected, "declared": declared, "stopped": stopped}), 0.0
    ).splitlines()
    assert "  hang limit: suspected at 30.0s without progress, killed at 40.0s (calibrated; upper bound 120s)" in lines
    title = lines.index("suspected of hanging (no progress in its process tree; its stack is in the job's output):")
    assert [line.split() for line in lines[title + 1 : title + 3]] == [
        ["HOST", "LOCAL", "RANK", "PID", "NO", "PROGRESS", "S", "KILLED", "AT", "S"],
        ["host-3", "0", "2", "4242", "31.2", "40.0"],
    ]
    title = lines.index("stopped inside a collective (by a signal or a debugger; the others wait for it):")
    assert [line.split() for line in lines[title + 1 : title + 3]] == [
        ["HOST", "LOCAL", "RANK", "STOPPED", "S"],
        ["host-2", "0", "2", "6.4"],
    ]
    title = lines.index("declared waits (no hang judged while they last):")
    assert [line.split() for line in lines[title + 1 : title + 3]] == [
        ["HOST", "LOCAL", "RANK", "REASON", "LEFT", "S"],
        ["host-1", "1", "1", "fetching", "shard", "7", "512.3"],
    ]
    title = lines.index("slowest ranks (seconds the others waited for each):")
    assert [line.split() for line in lines[title + 1 : title + 4]] == [
        ["HOST", "LOCAL", "RANK", "LOST", "S/MIN", "LOST", "S"],
        ["host-2", "1", "3", "10.2", "412.5"],
        ["host-1", "0", "0", "0.6", "3.1"],
    ]


def test_a_limit_at_the_upper_bound_says_so_and_nothing_is_shown_without_limits_or_costs() -> None:
    capped = render(waits_view({"limit_s": 120.0, "upper_s": 120.0, "ranks": []}), 0.0)
    assert "  hang limit: 120s (the upper bound: the job's hung timeout)" in capped.splitlines()
    assert all(title not in capped for title in ("slowest ranks", "suspected", "stopped", "declared"))
    for waits in ({"limit_s": None, "upper_s": None, "ranks": []}, None):
        assert "hang limit" not in render(waits_view(waits), 0.0), "no running job detects hangs, or an older registry"


def test_the_table_shows_the_goodput_line_from_the_registrys_ledger() -> None:
    ledger = Ledger(0.0, 2)
    ledger.released(10.0, 1, 2)
    ledger.fault(50.0, 50.0, "crash", "host-2", "exited with code 1")
    ledger.released(52.0, 2, 2)
    totals = ledger.totals(100.0)
    view = waits_view(None)
    view["job"]["goodput"] = {**totals, "headline": headline(totals)}
    lines = render(view, 0.0).splitlines()
    assert (
        lines[1]
        == "  goodput 88.0% of 100.0s; most lost to start 10.0s, crash 2.0s (elasticctl report 1: where the rest went)"
    )
    view["job"]["goodput"] = None  # a registry from before the ledger
    assert "goodput" not in render(view, 0.0)


def test_each_hosts_record_failures_last_reason_and_next_check() -> None:
    failing = {"ok": False, "reason": "exit code 1: no mount", "checked_at": 90.0, "request": 0, "next_check": 120.0}
    unhealthy = {
        **host("host-1", None, None),
        "state": "unhealthy",
        "health": failing,
        "health_hold": "health check failed: exit code 1: no mount",
        "blacklist_count": 0,
    }
    cooling = {
        **host("host-2", None, None),
        "state": "blacklisted",
        "blacklisted": True,
        "cooldown_left": 40.0,
        "blacklist_reason": "round 3: crashed",
        "blacklist_count": 2,
    }
    returned = {**host("host-3", None, None), "blacklist_count": 1, "blacklist_reason": "round 2: crashed"}
    assert next_check_in(unhealthy, 100.0) == 20.0
    assert next_check_in(cooling, 100.0) == 40.0
    assert next_check_in(returned, 100.0) is None
    assert next_check_in({**unhealthy, "health": {**failing, "next_check": None}}, 100.0) == 0.0
    view = {
        **waits_view(None),
        "hosts": [{**h, "next_check_in": next_check_in(h, 100.0)} for h in (unhealthy, cooling)],
    }
    view["hosts"].append(returned)
    rows = {line.split()[0]: line for line in render(view, 100.0).splitlines() if line.strip()}
    assert "FAILURES" in rows["HOST"]
    assert rows["host-1"].endswith("health check failed: exit code 1: no mount (next check in 20s)")
    assert rows["host-2"].endswith("round 3: crashed (cooldown 40s left, then a health check)")
    assert rows["host-3"].split()[5] == "1" and rows["host-3"].endswith("last failure: round 2: crashed")


def test_status_says_a_host_lost_on_slurms_word_as_such() -> None:
    job = {"job": 1, "state": "running", "round": 2, "size": 1, "resets": 1, "exit_code": None, "reason": ""}
    row = {"host": "node2", "slots": 1, "state": "lost", "blacklisted": False, "lost_for": 1.25}
    view = {"job": job, "hosts": [{**row, "lost_declared": True}], "workers": [], "history": [], "waits": None}
    assert "its node is down (Slurm), lost 1.2s ago" in render(view, 0.0)
    assert "no heartbeat for 1.2s" in render({**view, "hosts": [row]}, 0.0)


def test_a_host_whose_workers_went_past_a_rounds_key_quota_is_named_and_no_other() -> None:
    view = waits_view(None)
    view["quota_refused"] = {"host-2": 3}
    lines = render(view, 0.0).splitlines()
    said = [line for line in lines if "quota" in line]
    assert said == ["  host-2: 3 key(s) refused past a round's quota (its workers set keys the job does not use)"]
    del view["quota_refused"]  # a rendezvous from before the quota
    assert "quota" not in render(view, 0.0)
