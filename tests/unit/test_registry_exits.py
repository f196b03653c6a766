"""WorkerExit: an agent's exit report read at the door, and what the exit means: a success, or a failure whose
host stays or not; the exit of a worker killed as hung, told with its stack (Driver.record_exit)."""

from __future__ import annotations

from typing import Any

import pytest
import structlog

from elastic_control_plane.bus.service import RequestError
from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.registry.decisions import Decision, reset_cause
from elastic_control_plane.services.registry.driver import Driver
from elastic_control_plane.services.registry.exits import MAX_STACK_BYTES, WorkerExit
from elastic_control_plane.services.registry.job import Job
from elastic_control_plane.services.registry.reports import FAILURE


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


HUNG = "hung: the others waited 3.4s for rank 2 (limit 3.0s, no progress for 3.3s)"


def test_a_hung_worker_fails_first_as_hung_and_keeps_its_host_when_restarted_in_place():
    killed = exit_report(exit_code=-9, restarting=True, hung=HUNG, stack="Thread 0x7f (most recent call first):\n")
    assert (killed.failure(), killed.host_stays) == (f"{HUNG}; restarting in place", True)
    assert killed.stack == "Thread 0x7f (most recent call first):\n"
    assert exit_report(exit_code=-9, hung="no progress").failure() == "hung: no progress", "said hung once"
    assert reset_cause(Decision("resume", killed.failure()), [killed.failure()]) == "worker_failed"


def test_a_hung_workers_stack_keeps_its_last_64_kib_and_odd_fields_count_as_absent():
    long = exit_report(exit_code=-9, hung=HUNG, stack="x" * 100 + "y" * MAX_STACK_BYTES)
    assert long.stack == "y" * MAX_STACK_BYTES
    odd = exit_report(exit_code=-9, hung=["no"], stack=3)
    assert (odd.hung, odd.stack, odd.failure()) == (None, "", "exited with code -9")
    assert exit_report(exit_code=-9, hung="").hung is None


class Outbox:
    def __init__(self) -> None:
        self.queued: list[tuple[str, dict[str, Any]]] = []

    def put(self, event: str, data: dict[str, Any]) -> None:
        self.queued.append((event, data))


def test_the_exit_of_a_current_worker_killed_as_hung_is_told_with_its_stack():
    job = Job.submitted(JobSpec.parse({"command": ["python", "train.py"]}), 1, now=0.0)
    job.begin_round(1, [["a", [0, 1]], ["b", [0]]], 1.0, {}, replacing=False)
    job.reports.record_started(("b", 0), 42)
    outbox = Outbox()
    driver = Driver(job, None, None, outbox, structlog.get_logger())  # type: ignore[arg-type]
    body = {"host": "b", "local_rank": 0, "pid": 42, "exit_code": -9, "restarting": True}
    assert driver.record_exit(WorkerExit.parse({**body, "hung": HUNG, "stack": "main thread"}), now=5.0)
    report = job.reports[("b", 0)]
    assert (report.state, report.reason, report.host_stays) == (FAILURE, f"{HUNG}; restarting in place", True)
    told = {"host": "b", "local_rank": 0, "rank": 2, "pid": 42, "reason": HUNG, "stack": "main thread"}
    assert outbox.queued == [("abort", {"round": 1}), ("worker_hung", told)]
    assert not driver.record_exit(WorkerExit.parse({**body, "pid": 41, "hung": HUNG}), now=6.0), "the slot has ended"
    assert len(outbox.queued) == 2
