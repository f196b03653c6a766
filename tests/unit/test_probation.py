"""The health gate and probation (services/discovery/admission.py, probation.py) on a HostSet with an injected clock,
and the health report's checks (bodies.health, bodies.settings' probation_clean)."""

from __future__ import annotations

import random

import pytest

from elastic_control_plane.bus.service import RequestError
from elastic_control_plane.services.discovery import bodies
from elastic_control_plane.services.discovery.admission import health_hold
from elastic_control_plane.services.discovery.hostset import ACTIVE, BLACKLISTED, UNHEALTHY, HostSet
from elastic_control_plane.services.discovery.probation import Probation, ask_recheck, uncordon


def report(ok: bool = True, reason: str = "", request: int = 0, checked_at: float | None = 1.0) -> dict:
    return {"ok": ok, "reason": reason, "checked_at": checked_at, "request": request, "next_check": None}


def hostset(*names: str) -> HostSet:
    hs = HostSet(rng=random.Random(0))
    hs.cooldown_range = (10.0, 100.0)
    for name in names:
        hs.register(name, 1, f"{name}-1", 0.0)
    return hs


def test_a_host_without_health_reports_is_not_gated():
    assert health_hold(None, 3) is None


def test_the_gate_holds_a_running_first_check_a_failed_one_and_a_stale_one():
    assert health_hold(report(checked_at=None), 0) == "first health check running"
    assert health_hold(report(ok=False, reason="no /dev/shm space"), 0) == "health check failed: no /dev/shm space"
    assert health_hold(report(request=1), 2) == "waiting for a fresh health check"
    assert health_hold(report(request=2), 2) is None


def test_an_unhealthy_host_is_not_available_and_says_why():
    hs = hostset("a", "b")
    hs.hosts["b"].health = report(ok=False, reason="exit 1")
    assert hs.state(hs.hosts["b"]) == UNHEALTHY
    assert [name for name, _ in hs.available()] == ["a"]
    row = {r["host"]: r for r in hs.describe(0.0)}["b"]
    assert row["state"] == "unhealthy" and row["health_hold"] == "health check failed: exit 1"
    hs.hosts["b"].health = report()
    assert [name for name, _ in hs.available()] == ["a", "b"]


def test_a_host_out_of_its_cooldown_waits_for_a_fresh_check():
    hs = hostset("a")
    hs.hosts["a"].health = report()
    until = hs.blacklist("a", 0.0, "crash")
    assert hs.state(hs.hosts["a"]) == BLACKLISTED
    for name in hs.lift_cooldowns(until):
        ask_recheck(hs, name)
    assert hs.state(hs.hosts["a"]) == UNHEALTHY  # its last pass began before the cooldown ended
    hs.hosts["a"].health = report(request=1)
    assert hs.state(hs.hosts["a"]) == ACTIVE


def test_a_flapping_host_waits_longer_each_time_and_a_clean_one_starts_fresh():
    hs, probation = hostset("a"), Probation(clean_window=60.0)
    first = hs.blacklist("a", 0.0, "crash")
    hs.lift_cooldowns(first)
    probation.sweep(hs, first)
    second = hs.blacklist("a", first + 5.0, "crash") - (first + 5.0)
    assert hs.hosts["a"].blacklist_count == 2 and second > first  # 10-12.5 s, then 20-25 s
    now = first + 5.0 + second
    hs.lift_cooldowns(now)
    assert probation.sweep(hs, now) == []  # the clean run starts
    assert probation.sweep(hs, now + 59.0) == []
    assert probation.sweep(hs, now + 60.0) == ["a"]
    assert hs.hosts["a"].blacklist_count == 0
    assert hs.blacklist("a", now + 61.0, "crash") - (now + 61.0) <= 12.5  # the shortest cooldown again


def test_a_clean_run_stops_while_the_host_is_unavailable():
    hs, probation = hostset("a"), Probation(clean_window=60.0)
    hs.lift_cooldowns(hs.blacklist("a", 0.0, "crash"))
    probation.sweep(hs, 20.0)
    hs.hosts["a"].health = report(ok=False, reason="exit 1")
    probation.sweep(hs, 50.0)
    hs.hosts["a"].health = report()
    assert probation.sweep(hs, 90.0) == []  # clean again only from 90 s
    assert probation.sweep(hs, 150.0) == ["a"]


def test_without_a_clean_window_the_count_is_kept():
    hs, probation = hostset("a"), Probation(clean_window=None)
    hs.lift_cooldowns(hs.blacklist("a", 0.0, "crash"))
    probation.sweep(hs, 20.0)
    assert probation.sweep(hs, 10_000.0) == [] and hs.hosts["a"].blacklist_count == 1


def test_uncordon_clears_the_blacklist_and_count_and_asks_a_fresh_check():
    hs = hostset("a")
    hs.hosts["a"].health = report()
    hs.blacklist("a", 0.0, "crash")
    hs.blacklist("a", 1.0, "crash")
    uncordon(hs, "a")
    record = hs.hosts["a"]
    assert (record.blacklisted_until, record.blacklist_count) == (None, 0)
    assert hs.state(record) == UNHEALTHY
    record.health = report(request=record.health_wanted)
    assert hs.state(record) == ACTIVE


@pytest.mark.parametrize(
    "health",
    [
        "ok",
        {"ok": "yes"},
        {"ok": True, "reason": 3},
        {"ok": True, "checked_at": "now"},
        {"ok": True, "checked_at": True},
        {"ok": True, "request": -1},
        {"ok": True, "next_check": [1]},
    ],
)
def test_a_malformed_health_report_is_refused(health):
    with pytest.raises(RequestError) as refused:
        bodies.health({"health": health})
    assert refused.value.code == "bad_request"


def test_a_health_report_is_kept_in_its_checked_form():
    long = "x" * 2000
    kept = bodies.health({"health": {"ok": False, "reason": long, "checked_at": 5, "request": 2, "extra": 1}})
    assert kept == {"ok": False, "reason": long[: bodies.MAX_REASON], "checked_at": 5, "request": 2, "next_check": None}
    assert bodies.health({}) is None


def test_probation_clean_setting():
    assert bodies.settings({}).probation_clean == 600.0
    assert bodies.settings({"probation_clean": None}).probation_clean is None
    assert bodies.settings({"probation_clean": 30}).probation_clean == 30.0
    for bad in (-1, "10", True):
        with pytest.raises(RequestError):
            bodies.settings({"probation_clean": bad})
