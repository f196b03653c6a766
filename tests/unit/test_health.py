"""bus/health.py's judgments: a loop is alive until it stalls past LOOP_STALL_S (and while none runs: a standby), a
readiness condition is the process's own; an agent's (agent/agent.py `readiness`) holds while its host's health
check has not passed (agent/host_health.py `unready`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from elastic_control_plane.agent.agent import AgentService
from elastic_control_plane.agent.host_health import HealthSettings, HostHealth
from elastic_control_plane.bus import health
from tests.unit.test_host_health import Log, finish


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


def test_an_agent_is_not_ready_while_its_first_health_check_runs_or_its_last_one_failed(tmp_path: Path) -> None:
    verdict = tmp_path / "verdict"
    verdict.write_text("1")
    checks = HostHealth(HealthSettings(command=f"echo 'disk full'; exit $(cat {verdict})", interval=0.01), Log())
    agent = SimpleNamespace(link=SimpleNamespace(registered=True, warm=True), health=checks)
    health.ready_when(lambda: AgentService.readiness(agent))  # type: ignore[arg-type]
    try:
        assert health.CHECKS["/readyz"]() == "first health check running"
        checks.start()
        assert finish(checks)
        assert health.readiness() == "health check failed: exit code 1: disk full"
        verdict.write_text("0")
        checks.start()  # the recheck a failing host makes after its interval: not ready until it passes
        assert health.readiness() == "health check failed: exit code 1: disk full"
        assert finish(checks)
        assert health.readiness() is None
        agent.link.warm = False
        assert health.readiness() == "the workers' interpreter is not warm yet"
    finally:
        checks.close()
