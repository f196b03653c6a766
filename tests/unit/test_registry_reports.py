"""ReportTable: the registry's reports of a round, driven without processes: the barrier, crashes recorded and
counted in the order they came, silent slots found without a scan, the rows saved per host and only when they
changed, and leftovers of older rounds told from current workers."""

from __future__ import annotations

import json
import time

import pytest

from elastic_control_plane.services.registry.reports import (
    FAILURE,
    PENDING,
    RETIRED_PIDS_KEPT,
    ROW_FIELDS,
    RUNNING,
    SUCCESS,
    ReportTable,
    SlotReport,
)


def round_of(*slots: tuple[str, int]) -> ReportTable:
    """A table whose round has `slots`, ranked in the order given, all PENDING."""
    table = ReportTable()
    table.begin_round((slot, rank) for rank, slot in enumerate(slots))
    return table


def started(*slots: tuple[str, int]) -> ReportTable:
    """A released round: every slot RUNNING, with pid 1000 + its rank."""
    table = round_of(*slots)
    for rank, slot in enumerate(slots):
        table.record_started(slot, 1000 + rank)
    return table


# -- the barrier ---------------------------------------------------------------------------------


def test_new_slot_report_starts_pending():
    assert SlotReport(rank=0).state == PENDING
    assert round_of(("a", 0))[("a", 0)] == SlotReport(rank=0)


def test_barrier_complete_when_every_slot_reported():
    table = started(("a", 0), ("a", 1), ("b", 0))
    table.record_rejoined(("a", 0), 1000)
    table.record_success(("a", 1), 1001, 0, "exited with code 0")
    table.record_failure(("b", 0), "exited with code 1", exit_code=1)
    assert table.all_reported() is True


@pytest.mark.parametrize("waiting", [PENDING, RUNNING])
def test_barrier_incomplete_while_a_slot_has_not_reported(waiting):
    table = round_of(("a", 0), ("a", 1), ("b", 0))
    table.record_rejoined(("a", 0), 1000)
    table.record_failure(("b", 0), "exited with code 1", exit_code=1)
    if waiting == RUNNING:
        table.record_started(("a", 1), 1001)
    assert table[("a", 1)].state == waiting
    assert table.all_reported() is False


def test_barrier_of_no_slots_is_not_complete():
    assert ReportTable().all_reported() is False


# -- failures ------------------------------------------------------------------------------------


def test_a_crash_is_recorded_and_counted():
    table = started(("a", 0), ("b", 0), ("c", 0))
    assert table.record_failure(("b", 0), "exited with code 3", pid=1001, exit_code=3) is True, (
        "the round's first failure"
    )
    assert table[("b", 0)] == SlotReport(
        rank=1, state=FAILURE, pid=1001, exit_code=3, reason="exited with code 3", failed_order=1
    )
    assert table.record_failure(("a", 0), "host lost (missed heartbeats)") is False
    assert table[("a", 0)].pid == 1000, "a failure without a pid keeps the worker's"
    assert (table[("a", 0)].failed_order, table.count(FAILURE), table.count(RUNNING)) == (2, 2, 1)
    assert [slot for slot, _ in table.failures()] == [("b", 0), ("a", 0)], "in the order they failed"


def test_a_crash_whose_slot_restarts_in_place_keeps_its_host():
    table = started(("a", 0))
    table.record_failure(("a", 0), "exited with code -9; restarting in place", exit_code=-9, host_stays=True)
    assert table[("a", 0)].host_stays is True


def test_failures_on_a_host_are_described_in_rank_order():
    table = started(("a", 0), ("a", 1), ("b", 0))
    table.record_failure(("a", 1), "exited with code 2", exit_code=2)
    table.record_failure(("a", 0), "exited with code 1", exit_code=1)
    assert table.failures_on(["a", "b"]) == {
        "a": ["rank 0 on a exited with code 1", "rank 1 on a exited with code 2"],
        "b": [],
    }


def test_silent_slots_are_the_pending_and_running_ones():
    table = started(("a", 0), ("a", 1), ("b", 0), ("b", 1))
    table.record_success(("a", 1), 1001, 0, "exited with code 0")
    table.record_rejoined(("b", 0), 1002)
    assert sorted(table.silent()) == [("a", 0), ("b", 1)]


def test_hung_slots_are_found_and_failed_in_constant_time_per_slot():
    """4,096 hosts x 8: the slots still silent are named without a scan, and failing them one by one (as the hung
    check does) costs the same for each: quadratic work would take minutes here, not a fraction of a second."""
    slots = [(f"host-{h}", s) for h in range(4096) for s in range(8)]
    table = round_of(*slots)
    for slot in slots[2:]:
        table.record_rejoined(slot, 7)
    assert table.silent() == [slots[0], slots[1]]
    table = round_of(*slots)
    began = time.monotonic()
    for order, slot in enumerate(table.silent(), start=1):
        table.record_failure(slot, "hung")
        assert table[slot].failed_order == order
    assert time.monotonic() - began < 5.0
    assert table.all_reported() and table.count(FAILURE) == len(slots)


# -- saving: a row per host, the changed ones only ------------------------------------------------


def saved_rows(table: ReportTable) -> dict[str, list | None]:
    """The rows `table` has to save, parsed, now marked saved."""
    rows = table.unsaved_rows()
    table.saved(rows)
    return {host: None if row is None else json.loads(row) for host, row in rows.items()}


def test_only_the_hosts_whose_reports_changed_are_saved_again():
    table = started(("a", 0), ("a", 1), ("b", 0))
    assert sorted(saved_rows(table)) == ["a", "b"], "a new round is saved whole"
    assert table.unsaved_rows() == {}, "nothing changed since"
    table.record_started(("a", 0), 4242)
    table.record_rejoined(("c", 1), 4242)
    assert table.unsaved_rows() == {}, "a started slot that is not pending, or a slot not in the round, changes nothing"
    table.record_failure(("b", 0), "exited with code 1", exit_code=1)
    assert saved_rows(table) == {"b": [[0, 2, FAILURE, 1002, 1, "exited with code 1", 1, False]]}
    assert dict(zip(ROW_FIELDS, saved_rows(started(("a", 0)))["a"][0], strict=True)) == {
        "local_rank": 0,
        "rank": 0,
        "state": RUNNING,
        "pid": 1000,
        "exit_code": None,
        "reason": "",
        "failed_order": 0,
        "host_stays": False,
    }


def test_a_new_round_drops_the_rows_of_the_hosts_it_left():
    table = started(("a", 0), ("b", 0))
    saved_rows(table)
    table.begin_round([(("a", 0), 0), (("c", 0), 1)])
    assert saved_rows(table) == {
        "b": None,
        "a": [[0, 0, PENDING, None, None, "", 0, False]],
        "c": [[0, 1, PENDING, None, None, "", 0, False]],
    }
    table.begin_round([(("a", 0), 0)])
    assert saved_rows(table) == {"c": None, "a": [[0, 0, PENDING, None, None, "", 0, False]]}, "b's row went already"


def test_a_new_job_s_table_drops_the_rows_the_old_job_saved():
    old = started(("a", 0), ("b", 0))
    saved_rows(old)
    table = ReportTable()
    table.replaces(old)
    assert saved_rows(table) == {"a": None, "b": None}
    table.begin_round([(("a", 0), 0)])
    assert saved_rows(table) == {"a": [[0, 0, PENDING, None, None, "", 0, False]]}


def test_saved_rows_load_back_equal_with_the_failures_in_their_order():
    table = started(("a", 0), ("a", 1), ("b", 0))
    table.record_success(("a", 0), 1000, 0, "exited with code 0")
    table.record_failure(("b", 0), "exited with code 1", exit_code=1)
    table.record_failure(("a", 1), "exited with code 2", exit_code=2)
    table.retired_pids.update(dict.fromkeys([11, 12]))
    again = ReportTable.from_saved(saved_rows(table), [11, 12])
    assert again == table
    assert again.count(SUCCESS) == 1 and again.count(FAILURE) == 2
    assert [slot for slot, _ in again.failures()] == [("b", 0), ("a", 1)]
    assert again.unsaved_rows() == {}, "what was loaded is saved"
    again.begin_round([(("a", 0), 0)])
    assert again.unsaved_rows()["b"] is None, "a loaded table knows which rows are saved"


def test_a_release_of_32768_slots_and_their_rows_take_a_fraction_of_a_second():
    """4,096 hosts x 8: a new round, every worker started, every row saved."""
    slots = [(f"host-{h}", s) for h in range(4096) for s in range(8)]
    began = time.monotonic()
    table = round_of(*slots)
    for pid, slot in enumerate(slots):
        table.record_started(slot, pid)
    rows = table.unsaved_rows()
    assert len(rows) == 4096
    assert time.monotonic() - began < 1.5


# -- workers of older rounds ---------------------------------------------------------------------


def test_a_stale_pid_from_an_older_round_is_ignored():
    table = started(("a", 0), ("b", 0))
    table.record_rejoined(("a", 0), 1000)  # a survivor, re-joined for the next round
    table.record_failure(("b", 0), "exited with code 1", pid=1001, exit_code=1)
    table.begin_round([(("a", 0), 0), (("b", 0), 1)])
    assert table[("a", 0)] == SlotReport(rank=0, pid=1000), "a survivor keeps its pid"
    assert table[("b", 0)] == SlotReport(rank=1)
    assert not table.is_current_worker(("b", 0), 1001), "the old round's worker of the slot"
    assert table.is_current_worker(("b", 0), 2001), "a new process, not yet started"
    assert table.is_current_worker(("a", 0), 1000) and not table.is_current_worker(("a", 0), 2000)
    table.record_started(("b", 0), 2001)
    assert not table.is_current_worker(("b", 0), 2002)


def test_a_slot_that_reported_its_end_has_no_current_worker():
    table = started(("a", 0))
    table.record_success(("a", 0), 1000, 0, "exited with code 0")
    assert not table.is_current_worker(("a", 0), 1000)
    assert not table.is_current_worker(("z", 0), 1000), "a slot not in the round"


def test_only_the_newest_retired_pids_are_kept():
    table = started(*[("a", s) for s in range(RETIRED_PIDS_KEPT + 10)])
    table.begin_round([])
    assert len(table.retired_pids) == RETIRED_PIDS_KEPT
    assert 1000 not in table.retired_pids and 1000 + RETIRED_PIDS_KEPT + 9 in table.retired_pids
