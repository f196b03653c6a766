"""bus/health.py's judgments: a loop is alive until it stalls past LOOP_STALL_S (and while none runs: a standby), a
readiness condition is the process's own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elastic_control_plane.bus import health


@pytest.fixture(autouse=True)
def fresh_health(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    now = [1000.0]
    monkeypatch.setattr(health.time, "monotonic", lambda: now[0])
    health.loop_stopped()
    health.ready_when(lambda: None)
    yield now
    health.loop_stopped()
    health.ready_when(lambda: None)


def test_a_loop_that_turns_is_alive_and_one_stalled_past_the_limit_is_not(fresh_health: list[float]) -> None:
    assert health.liveness() is None, "no loop yet: alive"
    health.loop_turned()
    fresh_health[0] += health.LOOP_STALL_S - 1
    assert health.liveness() is None, "a slow turn is not a stuck loop"
    fresh_health[0] += 2
    assert health.liveness() == f"the loop last turned {health.LOOP_STALL_S + 1:.0f} s ago"
    health.loop_turned()
    assert health.liveness() is None


def test_a_loop_that_stopped_is_not_a_stuck_one(fresh_health: list[float]) -> None:
    health.loop_turned()
    health.loop_stopped()  # a replica stepped down and stands by
    fresh_health[0] += 10 * health.LOOP_STALL_S
    assert health.liveness() is None


def test_readiness_is_what_the_process_says() -> None:
    assert health.readiness() is None
    health.ready_when(lambda: "not registered with discovery")
    assert health.readiness() == "not registered with discovery"
    assert health.CHECKS["/readyz"]() == "not registered with discovery" and health.CHECKS["/healthz"]() is None
