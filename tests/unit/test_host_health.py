"""The agent's health checks (agent/host_health.py): the built-in checks, one run of the operator's command (its exit
code, its timeout, nothing left behind), when runs start, and that a reply from discovery cannot name a command."""

from __future__ import annotations

import select
import time
from pathlib import Path

import pytest

from elastic_control_plane.agent.host_health import (
    CommandRun,
    HealthSettings,
    HostHealth,
    builtin_failure,
    check_settings,
)


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def info(self, event: str, **fields) -> None:
        self.lines.append((event, fields))

    warning = info


def finish(health: HostHealth, timeout: float = 20.0) -> bool:
    """Wait for the run's wake-up, as the agent's loop does, then take its outcome."""
    ready, _, _ = select.select([health.fileno()], [], [], timeout)
    assert ready, "the health check never ended"
    return health.finished()


def test_a_passing_command_reports_ok_and_answers_the_recheck_asked():
    health = HostHealth(HealthSettings(command="true"), Log())
    assert health.report()["checked_at"] is None
    health.ask(3)
    assert finish(health)
    report = health.report()
    assert (report["ok"], report["request"], report["next_check"]) == (True, 3, None)
    health.close()


def test_a_failing_command_gives_its_last_line_as_the_reason_and_a_next_check(tmp_path: Path):
    log = Log()
    health = HostHealth(HealthSettings(command="echo first; echo 'no ok-file' >&2; exit 3", interval=5.0), log)
    health.start()
    assert finish(health)
    report = health.report()
    assert not report["ok"] and report["reason"] == "exit code 3: no ok-file"
    assert report["next_check"] == pytest.approx(report["checked_at"] + 5.0, abs=0.01)
    assert ("health_checked", {"ok": False, "reason": report["reason"], "output": ["first", "no ok-file"]}) == (
        log.lines[-1][0],
        {k: v for k, v in log.lines[-1][1].items() if k != "request"},
    )
    health.close()


def test_a_hanging_command_is_killed_at_its_timeout_with_what_it_started(tmp_path: Path):
    marker = tmp_path / "pids"
    run = CommandRun(f"sleep 300 & echo $! > {marker}; sleep 300", timeout=0.5)
    started = time.monotonic()
    outcome = run.run()
    assert time.monotonic() - started < 10
    assert not outcome.ok and outcome.reason == "timed out after 0.5s"
    child = int(marker.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and Path(f"/proc/{child}").exists():
        if Path(f"/proc/{child}/stat").read_text().split()[2] == "Z":  # a zombie of init's, not ours to reap
            break
        time.sleep(0.05)
    alive = Path(f"/proc/{child}/stat").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z"
    assert not alive, "the check's background process outlived it"


def test_the_builtin_checks_fail_below_their_floors(tmp_path: Path):
    assert builtin_failure(HealthSettings(min_shm_mib=0, min_memory_mib=0)) is None
    assert "free, below" in builtin_failure(HealthSettings(min_shm_mib=1e12), shm=tmp_path)
    assert "of memory available, below" in builtin_failure(HealthSettings(min_shm_mib=0, min_memory_mib=1e12))
    assert "cannot be read" in builtin_failure(HealthSettings(), shm=tmp_path / "missing")


def test_a_host_without_gpus_skips_the_gpu_check_and_says_so_once():
    log = Log()
    HostHealth(HealthSettings(), log).close()
    assert [event for event, _ in log.lines] == ["health_gpu_check_skipped"]


def test_a_reply_can_only_ask_for_a_run_by_number():
    health = HostHealth(HealthSettings(command="true"), Log())
    for request in ("rm -rf /", {"command": "false"}, True, -1, 0):
        health.ask(request)
    assert health.asked == 0 and health.settings.command == "true"
    health.close()


@pytest.mark.parametrize(
    "settings, message",
    [
        (HealthSettings(timeout=0), "--health-check-timeout must be more than 0 seconds (got 0)"),
        (HealthSettings(interval=-1), "--health-check-interval must be more than 0 seconds (got -1)"),
        (HealthSettings(min_shm_mib=-5), "--health-min-shm must be 0 MiB or more (got -5)"),
        (HealthSettings(command="  "), "--health-check must be a command (got an empty one)"),
    ],
)
def test_settings_that_cannot_work_are_refused(settings, message):
    with pytest.raises(ValueError) as refused:
        check_settings(settings)
    assert str(refused.value) == message


def test_a_run_asked_for_while_one_goes_on_follows_it():
    health = HostHealth(HealthSettings(command="sleep 0.3"), Log())
    health.start()
    health.ask(1)  # under way: it answers recheck 0
    assert finish(health) and health.report()["request"] == 0
    assert finish(health) and health.report()["request"] == 1
    health.close()


def test_a_check_that_prints_megabytes_is_judged_by_its_last_lines_read_from_the_end_alone() -> None:
    outcome = CommandRun("yes filler | head -c 8000000; echo; echo 'disk 3 failed'; exit 4", timeout=30.0).run()
    assert not outcome.ok and outcome.reason == "exit code 4: disk 3 failed"
    assert outcome.output[-1] == "disk 3 failed" and len(outcome.output) <= 5
