"""The restart policy of crashed slots (agent/restarts.py): back-off, the window, giving up."""

from __future__ import annotations

import pytest

from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.restarts import CrashHistory, RestartPolicy, backoff, give_up_reason
from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.job.spec import SpecError


def test_first_crash_restarts_at_once_then_the_delay_doubles_up_to_the_cap():
    assert [backoff(n) for n in range(1, 6)] == [0.0, 1.0, 2.0, 4.0, 8.0]
    assert backoff(40) == INTERVALS.restart_backoff_cap


def test_more_than_max_restarts_crashes_in_the_window_gives_the_slot_up():
    history, policy = CrashHistory(), RestartPolicy(max_restarts=3, window=60.0)
    assert [history.record(0, t, policy) for t in (0.0, 1.0, 3.0)] == [0.0, 1.0, 2.0]
    assert history.record(0, 6.0, policy) is None


def test_crashes_older_than_the_window_no_longer_count():
    history, policy = CrashHistory(), RestartPolicy(max_restarts=2, window=10.0)
    assert history.record(0, 0.0, policy) == 0.0
    assert history.record(0, 5.0, policy) == 1.0
    assert history.record(0, 12.0, policy) == 1.0, "the crash at 0 fell out of the window"
    assert history.record(0, 30.0, policy) == 0.0


def test_slots_are_counted_apart():
    history, policy = CrashHistory(), RestartPolicy(max_restarts=1, window=60.0)
    assert history.record(0, 0.0, policy) == 0.0
    assert history.record(1, 0.5, policy) == 0.0
    assert history.record(0, 1.0, policy) is None


def test_zero_max_restarts_is_horovods_rule():
    history, policy = CrashHistory(), RestartPolicy(max_restarts=0, window=60.0)
    assert history.record(0, 0.0, policy) is None
    assert "first crash" in give_up_reason(1, policy)


def test_history_stays_bounded_over_any_number_of_crashes():
    history, policy = CrashHistory(), RestartPolicy(max_restarts=3, window=1e9)
    for t in range(10_000):
        history.record(0, float(t), policy)
    assert history.count(0) == 4


@pytest.mark.parametrize(
    "spec, expected",
    [({}, RestartPolicy()), ({"max_restarts": 5, "restart_window": 30}, RestartPolicy(5, 30.0))],
)
def test_policy_of_a_job(spec, expected):
    wire = {"job": 1, "job_key": "k", "spec": {"command": ["python", "train.py"], **spec}}
    assert RestartPolicy.of_plan(JobPlan.from_wire(wire)) == expected


def test_a_plan_that_breaks_the_specs_rules_is_refused_by_them():
    wire = {"job": 1, "job_key": "k", "spec": {"command": ["python", "train.py"], "max_restarts": -1}}
    with pytest.raises(SpecError, match="max_restarts must be at least 0"):
        JobPlan.from_wire(wire)
