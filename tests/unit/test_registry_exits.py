"""WorkerExit: an agent's exit report read at the door, and what the exit means: a success, or a failure whose
host stays or not."""

from __future__ import annotations

import pytest

from bus.service import RequestError
from services.registry.exits import WorkerExit


def exit_report(**body: object) -> WorkerExit:
    return WorkerExit.parse({"host": "a", "local_rank": 1, "pid": 42, **body})


def test_exit_code_zero_is_a_success():
    assert exit_report(exit_code=0).success() == "exited with code 0"


def test_a_signal_after_the_script_ended_is_a_success():
    assert (
        exit_report(exit_code=-11, after_script_end=True).success()
        == "its script ended, then it died of signal 11 in interpreter teardown"
    )


@pytest.mark.parametrize("body", [{"exit_code": 1, "after_script_end": True}, {"exit_code": -9}, {"exit_code": None}])
def test_anything_else_is_a_failure(body):
    assert exit_report(**body).success() is None


def test_a_crash_restarted_in_place_keeps_its_host():
    crashed = exit_report(exit_code=-9, restarting=True)
    assert (crashed.host_stays, crashed.failure()) == (True, "exited with code -9; restarting in place")


def test_a_slot_given_up_costs_its_host():
    crashed = exit_report(exit_code=1, restarting=True, gave_up="crashed 4 times in 60s")
    assert (crashed.host_stays, crashed.failure()) == (False, "exited with code 1; crashed 4 times in 60s")


def test_optional_fields_of_a_wrong_type_count_as_absent():
    odd = exit_report(exit_code=1, restarting="yes", gave_up="", after_script_end=1, snapshot_commit=True)
    assert (odd.restarting, odd.gave_up, odd.after_script_end, odd.snapshot_commit) == (False, None, False, 0)
    assert exit_report(snapshot_commit=-3).snapshot_commit == 0
    assert exit_report(snapshot_commit=17).snapshot_commit == 17


@pytest.mark.parametrize("missing", ["host", "local_rank", "pid"])
def test_a_report_without_its_slot_or_pid_is_a_bad_request(missing):
    body = {"host": "a", "local_rank": 1, "pid": 42}
    del body[missing]
    with pytest.raises(RequestError, match=missing):
        WorkerExit.parse(body)
