"""The goodput ledger's accounting, driven with explicit instants: every transition puts each second in one bucket,
the buckets always add up to the wall clock, lost work comes from reported commits (a late one gives seconds back),
each interruption is charged to its cause and host only, and what it keeps is bounded and saved."""

from __future__ import annotations

import json
import random

import pytest

from elastic_control_plane.services.registry import ledger_record
from elastic_control_plane.services.registry.ledger import (
    BELOW_SIZE,
    BUCKETS,
    CHECKPOINTING,
    CRASH,
    DETECTING,
    DRAIN,
    HANG,
    HOSTS_KEPT,
    LOST_HOST,
    LOST_WORK,
    OTHER_HOSTS,
    PAUSED,
    REFORMING,
    RESTART,
    SAVE_EVERY_S,
    START,
    TIMELINE_KEPT,
    TRAINING,
    WAITING_FOR_HOSTS,
    Ledger,
)

WALL = 1_700_000_000.0


def as_wall(local: float) -> float:
    return WALL + local


def as_local(wall: float) -> float:
    return wall - WALL


def view(ledger: Ledger, now: float) -> dict:
    return ledger.view(now, as_wall)


def started(asked: int = 4) -> Ledger:
    """A job submitted at 0 that found its slots at 1 and trained from 3 at full size."""
    ledger = Ledger(0.0, asked)
    ledger.slots(1.0, enough=True)
    ledger.released(3.0, 1, asked or 4)
    ledger.committed(3.0, 0, None)  # the workers' commits are reported; none made yet
    return ledger


def crash_and_back(ledger: Ledger, committed_at: float, crashed_at: float, back_at: float, round_number: int) -> None:
    """Commit 1 reported as made at `committed_at`, a crash of host-1 at `crashed_at`, decided at once; the next
    round released at `back_at`."""
    ledger.committed(committed_at, commit=1, age_s=0.0)
    ledger.fault(crashed_at, crashed_at, CRASH, "host-1", "crash")
    ledger.decided(crashed_at)
    ledger.released(back_at, round_number, 4)


def assert_adds_up(ledger: Ledger, now: float, start: float = 0.0) -> dict:
    shown = view(ledger, now)
    assert sum(shown["buckets"].values()) == pytest.approx(now - start, abs=1e-2)
    assert shown["wall_s"] == pytest.approx(now - start, abs=1e-3)
    return shown


def test_the_start_is_waiting_then_reforming_then_training_charged_to_start():
    ledger = started()
    shown = assert_adds_up(ledger, 10.0)
    assert shown["buckets"][WAITING_FOR_HOSTS] == 1.0
    assert shown["buckets"][REFORMING] == 2.0
    assert shown["buckets"][TRAINING] == 7.0
    assert shown["causes"][START] == 3.0
    assert shown["training_share"] == 0.7
    assert [entry["cause"] for entry in shown["interruptions"]] == [START]


def test_a_crash_is_detecting_reforming_and_the_work_since_the_last_commit_is_lost():
    ledger = started()
    ledger.committed(8.0, commit=5, age_s=1.0)  # commit 5 made at 7
    ledger.fault(10.0, 10.0, CRASH, "host-1", "rank 1 on host-1 exited with code 1")
    ledger.decided(11.0)
    ledger.slots(11.5, enough=True)
    ledger.released(12.5, 2, 4)
    shown = assert_adds_up(ledger, 20.0)
    buckets = shown["buckets"]
    assert buckets[DETECTING] == 1.0
    assert buckets[REFORMING] == 2.0 + 1.5
    assert buckets[LOST_WORK] == 3.0  # trained 7 -> 10 since commit 5
    assert buckets[TRAINING] == (10.0 - 3.0 - 3.0) + 7.5
    crash = shown["interruptions"][-1]
    assert crash | {"at": None} == crash | {
        "cause": CRASH,
        "host": "host-1",
        "at": None,
        "detecting": 1.0,
        "reforming": 1.5,
        "lost_work": 3.0,
        "rolled_back_to": 5,
    }
    assert crash["at"] == WALL + 10.0
    assert shown["causes"][CRASH] == 1.0 + 1.5 + 3.0
    assert shown["hosts"] == {"host-1": 5.5}


def test_reforming_runs_until_the_round_s_state_is_synced_not_its_release():
    ledger = started()
    crash_and_back(ledger, 9.0, 10.0, 11.0, 2)
    ledger.resumed(12.0, 2, age_s=0.5)  # synced at 11.5: re-forming until then
    ledger.resumed(12.5, 2, age_s=0.2)  # another host's report of the same round: counted once
    ledger.resumed(12.5, 1, age_s=0.0)  # an older round's: ignored
    shown = assert_adds_up(ledger, 20.0)
    assert shown["buckets"][REFORMING] == 2.0 + 1.0 + 0.5
    assert shown["interruptions"][-1]["reforming"] == 1.5
    assert shown["causes"][CRASH] == 1.0 + 1.5
    ledger.fault(21.0, 21.0, CRASH, "host-1", "crash")
    ledger.decided(21.0)
    ledger.released(22.0, 3, 4)
    assert view(ledger, 23.0)["buckets"][LOST_WORK] == 1.0 + 9.5, "lost work runs from the sync, not the release"


def test_a_commit_reported_late_gives_lost_seconds_back_and_one_after_the_new_start_changes_nothing():
    ledger = started()
    crash_and_back(ledger, 4.0, 10.0, 11.0, 2)
    assert view(ledger, 11.0)["buckets"][LOST_WORK] == 6.0
    ledger.committed(11.2, commit=2, age_s=2.2)  # made at 9, before the crash
    shown = assert_adds_up(ledger, 12.0)
    assert shown["buckets"][LOST_WORK] == pytest.approx(1.0)
    assert shown["interruptions"][-1]["rolled_back_to"] == 2
    ledger.committed(15.0, commit=3, age_s=0.5)  # the new stretch's first: the rollback is final
    ledger.committed(15.5, commit=2, age_s=6.0)  # an older one, from a slower host: ignored
    assert assert_adds_up(ledger, 16.0)["buckets"][LOST_WORK] == pytest.approx(1.0)


def test_a_hang_is_detected_from_the_start_of_its_stall():
    ledger = started()
    ledger.committed(20.0, commit=9, age_s=0.0)
    ledger.fault(60.0, 20.0, HANG, "host-2", "hung: the others waited 40.0s")  # stalled since 20
    ledger.decided(61.0)
    ledger.released(62.0, 2, 4)
    shown = assert_adds_up(ledger, 70.0)
    assert shown["buckets"][DETECTING] == 41.0
    assert shown["buckets"][LOST_WORK] == 0.0
    assert shown["hosts"] == {"host-2": 42.0}


def drained(resumed_at: float) -> Ledger:
    """Commit 3 known at 8; host-3 drained: the registry sees the workers re-join at 10 (they left at commit 4, at
    9.95, not reported yet), decides at 10.1, releases the next round at 10.3; its state is synced at `resumed_at`."""
    ledger = started()
    ledger.committed(8.0, commit=3, age_s=0.0)
    ledger.fault(10.0, 10.0, DRAIN, "host-3", "hosts changed", planned=True)
    ledger.decided(10.1)
    ledger.released(10.3, 2, 3)
    ledger.resumed(resumed_at, 2, age_s=0.0)
    return ledger


def test_a_commit_reported_after_the_fault_with_an_instant_after_it_was_made_before_it():
    """A planned change interrupts at a commit; its report, queued behind a busy registry, dates it a little late."""
    ledger = drained(resumed_at=10.8)
    assert view(ledger, 10.8)["buckets"][DETECTING] == pytest.approx(0.1 + 2.0)
    ledger.committed(10.85, commit=3, age_s=2.6)  # commit 3 again, its report queued: dated 8.25, nothing changes
    assert view(ledger, 10.85)["buckets"][DETECTING] == pytest.approx(0.1 + 2.0)
    ledger.committed(10.9, commit=4, age_s=0.4)  # dated 10.5: after the fault, before the new stretch
    shown = assert_adds_up(ledger, 11.0)
    assert shown["buckets"][DETECTING] == pytest.approx(0.1) and shown["interruptions"][-1]["rolled_back_to"] == 4


def test_a_planned_change_s_commit_reported_after_training_resumed_is_still_the_one_the_workers_left_at():
    ledger = drained(resumed_at=10.4)
    ledger.committed(11.0, commit=4, age_s=0.3)  # dated 10.7, after training resumed: its report was queued
    assert view(ledger, 11.0)["buckets"][DETECTING] == pytest.approx(0.1) and ledger.rollback is None
    assert ledger.timeline[-1]["rolled_back_to"] == 4
    ledger.committed(12.0, commit=5, age_s=0.0)  # the new stretch's: the rollback is final
    ledger.committed(12.5, commit=6, age_s=0.0)
    assert assert_adds_up(ledger, 13.0)["buckets"][DETECTING] == pytest.approx(0.1)


def test_a_planned_change_whose_commit_is_never_reported_charges_no_training_once_a_later_commit_comes():
    """The drained workers left at commit 4, whose report never came (their host's snapshot writer was cut short);
    the new stretch's commit 5 is the first reported: the training since commit 3 was kept, not detecting."""
    ledger = drained(resumed_at=10.4)
    assert view(ledger, 11.0)["buckets"][DETECTING] == pytest.approx(0.1 + 2.0)
    ledger.committed(11.5, commit=5, age_s=0.0)
    shown = assert_adds_up(ledger, 12.0)
    assert shown["buckets"][DETECTING] == pytest.approx(0.1) and shown["buckets"][LOST_WORK] == 0.0
    assert shown["interruptions"][-1]["rolled_back_to"] == 4 and ledger.rollback is None


def test_a_crash_s_lost_work_stays_when_a_later_commit_comes():
    """Beside it, the guilty case: after a crash the work since the last commit was rolled back and done again; a
    commit of the new stretch gives nothing back."""
    ledger = started()
    ledger.committed(8.0, commit=3, age_s=0.0)
    ledger.fault(10.0, 10.0, CRASH, "host-2", "exit 1")
    ledger.decided(10.1)
    ledger.released(10.3, 2, 3)
    ledger.committed(11.5, commit=4, age_s=0.0)
    assert assert_adds_up(ledger, 12.0)["buckets"][LOST_WORK] == pytest.approx(2.0)


def test_a_lost_host_whose_workers_went_on_committing_is_detected_from_the_last_commit_not_its_last_heartbeat():
    """Its agent stopped at 7 (the last heartbeat) but its workers trained on: every rank made commit 4 at 9; the loss
    found at 10 began no earlier than that commit. Beside it, a host that went silent with its workers (no commit
    since its last heartbeat) is detected from that heartbeat."""
    went_on = started()
    went_on.committed(9.2, commit=4, age_s=0.2)
    went_on.fault(10.0, 7.0, LOST_HOST, "host-3", "lost")
    went_on.decided(10.0)
    assert view(went_on, 10.0)["buckets"][DETECTING] == pytest.approx(1.0)
    silent = started()
    silent.committed(6.5, commit=3, age_s=0.0)
    silent.fault(10.0, 7.0, LOST_HOST, "host-3", "lost")
    silent.decided(10.0)
    assert view(silent, 10.0)["buckets"][DETECTING] == pytest.approx(3.0)


def test_a_planned_change_rolls_nothing_back_its_stretch_since_the_commit_is_detecting():
    ledger = started()
    ledger.committed(9.9, commit=4, age_s=0.0)  # the workers leave at this commit; the registry sees them at 10
    ledger.fault(10.0, 10.0, DRAIN, "host-3", "hosts changed", planned=True)
    ledger.decided(10.5)
    ledger.released(11.0, 2, 3)
    shown = assert_adds_up(ledger, 12.0)
    assert shown["buckets"][LOST_WORK] == 0.0
    assert shown["buckets"][DETECTING] == pytest.approx(0.6)
    assert shown["interruptions"][-1]["detecting"] == pytest.approx(0.6)


def test_workers_that_rejoin_before_their_fault_is_told_stopped_training_then():
    ledger = started()
    ledger.committed(5.0, commit=2, age_s=0.0)
    ledger.stopped(8.0)  # an agent killed: the survivors' collective fails; the registry sees its new agent later
    ledger.stopped(8.5)
    ledger.fault(10.0, 10.0, CRASH, "host-1", "its agent restarted")
    ledger.decided(10.5)
    ledger.released(11.0, 2, 4)
    shown = assert_adds_up(ledger, 12.0)
    assert shown["buckets"][LOST_WORK] == 3.0 and shown["buckets"][DETECTING] == 2.5


def test_a_second_fault_during_an_interruption_is_counted_in_it():
    ledger = started()
    ledger.fault(10.0, 10.0, CRASH, "host-1", "crash")
    ledger.fault(10.2, 10.2, CRASH, "host-1", "its exit report")  # the same fault told twice: counted once
    ledger.fault(10.5, 10.5, HANG, "host-2", "hung")
    ledger.decided(11.0)
    ledger.released(12.0, 2, 4)
    shown = assert_adds_up(ledger, 13.0)
    assert shown["interruptions"][-1]["faults"] == 2
    assert "host-2" not in shown["hosts"]


def test_every_worker_failed_is_a_restart_charged_to_no_host_whichever_failure_was_told_first():
    ledger = started()
    crash_and_back(ledger, committed_at=5.0, crashed_at=6.0, back_at=7.0, round_number=2)  # host-1's own: 1 + 1 s
    ledger.committed(9.0, commit=2, age_s=0.0)
    ledger.fault(10.0, 10.0, CRASH, "host-1", "rank 0 on host-1 exited with code -9")  # told first
    ledger.control_plane(10.5, available=False)
    ledger.control_plane(11.0, available=True)
    ledger.fault(11.2, 11.2, CRASH, "host-2", "rank 1 on host-2 exited with code -9")
    ledger.decided(12.0, restart=True)  # every worker failed: the job resumes from the hosts' snapshots
    ledger.released(13.0, 3, 4)
    shown = assert_adds_up(ledger, 20.0)
    restart = shown["interruptions"][-1]
    assert (restart["cause"], restart["host"], restart["faults"], restart["rolled_back_to"]) == (RESTART, "", 2, 2)
    assert (restart["detecting"], restart["paused"], restart["reforming"], restart["lost_work"]) == (1.5, 0.5, 1.0, 1.0)
    assert shown["causes"][RESTART] == 4.0
    assert shown["causes"][CRASH] == 1.0 + 1.0, "host-1's own crash before stays its (with its lost work)"
    assert shown["hosts"] == {"host-1": 2.0}, "the restart is charged to no host"


def test_a_restart_told_first_by_a_host_charged_nothing_else_leaves_it_uncharged():
    ledger = started()
    ledger.committed(9.0, commit=1, age_s=0.0)
    ledger.fault(10.0, 10.0, CRASH, "host-3", "crash")
    ledger.decided(11.0, restart=True)
    ledger.released(12.0, 2, 4)
    shown = assert_adds_up(ledger, 13.0)
    assert shown["hosts"] == {} and shown["causes"][RESTART] == 1.0 + 2.0 and shown["causes"][CRASH] == 0.0


def test_below_size_counts_the_missing_slots_and_waiting_below_min_np():
    ledger = started()
    ledger.committed(10.0, commit=3, age_s=0.0)  # a drain interrupts at a commit
    ledger.fault(10.0, 10.0, DRAIN, "host-3", "drained")
    ledger.decided(10.0)
    ledger.slots(10.0, enough=False)
    ledger.slots(14.0, enough=True)
    ledger.released(15.0, 2, 3)
    shown = assert_adds_up(ledger, 25.0)
    assert shown["buckets"][WAITING_FOR_HOSTS] == 1.0 + 4.0
    assert shown["buckets"][BELOW_SIZE] == 10.0
    assert shown["below_size"] == {"short_slot_s": 10.0, "mean_short": 1.0, "most_short": 1}
    assert shown["causes"][DRAIN] == 5.0
    assert shown["training_share"] == pytest.approx((7.0 + 10.0) / 25.0, abs=1e-4)


def test_without_max_np_the_size_asked_is_the_largest_the_job_had():
    ledger = started(asked=None)
    ledger.fault(10.0, 10.0, CRASH, "host-1", "crash")
    ledger.decided(10.0)
    ledger.released(11.0, 2, 3)
    assert view(ledger, 12.0)["asked"] == 4
    assert view(ledger, 12.0)["buckets"][BELOW_SIZE] == 1.0


def test_the_control_plane_out_of_reach_pauses_an_interruption_but_not_training():
    ledger = started()
    ledger.control_plane(5.0, available=False)
    ledger.control_plane(6.0, available=True)
    ledger.committed(10.0, commit=3, age_s=0.0)
    ledger.fault(10.0, 10.0, CRASH, "host-1", "crash")
    ledger.control_plane(10.5, available=False)
    ledger.decided(11.0)  # cannot happen while paused, but must not lose the pause
    ledger.control_plane(13.0, available=True)
    ledger.released(14.0, 2, 4)
    shown = assert_adds_up(ledger, 15.0)
    assert shown["buckets"][PAUSED] == 2.5
    assert shown["buckets"][DETECTING] == 0.5
    assert shown["buckets"][REFORMING] == 2.0 + 1.0
    assert shown["causes"][CRASH] == 4.0


def test_checkpointing_moves_the_mean_saving_time_out_of_training():
    ledger = started()
    ledger.saved_commits(4.0, "host-0", 0.5, hosts=2)  # the first report is a baseline
    ledger.saved_commits(5.0, "host-0", 2.5, hosts=2)
    ledger.saved_commits(5.0, "host-1", 1.0, hosts=2)
    ledger.saved_commits(6.0, "host-1", 3.0, hosts=2)
    shown = assert_adds_up(ledger, 10.0)
    assert shown["buckets"][CHECKPOINTING] == 2.0
    assert shown["buckets"][TRAINING] == 5.0


def test_a_finished_job_counts_nothing_more():
    ledger = started()
    ledger.ended(10.0)
    assert view(ledger, 50.0)["wall_s"] == 10.0
    assert not ledger.due(100.0) or ledger.changed


def test_random_transitions_always_add_up_to_the_wall_clock():
    rng = random.Random(49)
    ledger, now = started(), 3.0
    for _ in range(2000):
        now += rng.uniform(0, 2)
        step = rng.randrange(7)
        if step == 0:
            ledger.fault(now, now - rng.uniform(0, 5), rng.choice([CRASH, HANG, DRAIN]), f"h{rng.randrange(4)}", "")
        elif step == 1:
            ledger.decided(now)
        elif step == 2:
            ledger.slots(now, enough=rng.random() < 0.7)
        elif step == 3:
            ledger.released(now, ledger.round + 1, rng.randrange(1, 5))
        elif step == 4:
            ledger.committed(now, rng.randrange(100), rng.uniform(0, 3))
        elif step == 5:
            ledger.control_plane(now, available=rng.random() < 0.5)
        else:
            ledger.saved_commits(now, f"h{rng.randrange(4)}", now / 10, hosts=4)
        shown = assert_adds_up(ledger, now)
        assert min(shown["buckets"].values()) >= -1e-6
        assert sum(shown["causes"].values()) == pytest.approx(
            sum(shown["buckets"][b] for b in (DETECTING, REFORMING, WAITING_FOR_HOSTS, PAUSED, LOST_WORK)), abs=1e-2
        )
    assert len(ledger.timeline) == TIMELINE_KEPT


def test_lost_work_is_not_counted_before_the_commits_are_reported():
    ledger = Ledger(0.0, 2)
    ledger.released(1.0, 1, 2)
    ledger.fault(10.0, 10.0, CRASH, "host-1", "crash")
    ledger.released(11.0, 2, 2)
    shown = assert_adds_up(ledger, 12.0)
    assert shown["buckets"][LOST_WORK] == 0.0 and not shown["commits_seen"]


def test_hosts_charged_are_bounded_the_rest_goes_to_other_hosts():
    ledger, now = started(), 3.0
    for index in range(HOSTS_KEPT + 50):
        ledger.fault(now + 1, now + 1, CRASH, f"host-{index}", "crash")
        ledger.decided(now + 1 + (index % 3 + 1))
        now += 5
        ledger.released(now, ledger.round + 1, 4)
        ledger.saved_commits(now, f"host-{index}", 1.0, hosts=4)  # each host's saving time followed: bounded too
    shown = assert_adds_up(ledger, now)
    assert len(shown["hosts"]) == HOSTS_KEPT and len(ledger.saving_s) == HOSTS_KEPT
    assert shown["hosts"][OTHER_HOSTS] > 0
    assert sum(shown["hosts"].values()) == pytest.approx(shown["causes"][CRASH], abs=1e-3)


def test_saved_and_loaded_it_carries_on_and_the_registry_s_downtime_in_an_interruption_is_paused():
    ledger = started()
    ledger.committed(8.0, commit=5, age_s=1.0)
    ledger.fault(10.0, 10.0, CRASH, "host-1", "crash")
    saved = json.loads(json.dumps(ledger_record.to_saved(ledger, 10.5, as_wall)))
    timeline = json.loads(json.dumps(ledger_record.timeline_to_saved(ledger, as_wall)))
    ledger.saved(10.5, timeline=True)
    assert not ledger.due(11.0) and ledger.due(10.5 + SAVE_EVERY_S) and not ledger.timeline_changed
    # The next registry starts 4 s later on the wall clock, its monotonic clock reading otherwise.
    offset = 1000.0
    loaded = ledger_record.from_saved(saved, timeline, 14.5 + offset, lambda wall: wall - WALL + offset)
    loaded.control_plane(14.5 + offset, available=True)
    loaded.decided(15.0 + offset)
    loaded.released(16.0 + offset, 2, 4)
    shown = loaded.view(20.0 + offset, lambda local: local - offset + WALL)
    assert sum(shown["buckets"].values()) == pytest.approx(20.0)
    assert shown["buckets"][PAUSED] == pytest.approx(4.0)
    assert shown["buckets"][DETECTING] == pytest.approx(0.5 + 0.5)
    assert shown["buckets"][LOST_WORK] == pytest.approx(3.0)
    assert [entry["cause"] for entry in shown["interruptions"]] == [START, CRASH]
    assert shown["interruptions"][-1]["at"] == WALL + 10.0


def test_a_registry_down_while_training_counts_its_gap_as_training():
    ledger = started()
    saved = json.loads(json.dumps(ledger_record.to_saved(ledger, 5.0, as_wall)))
    loaded = ledger_record.from_saved(saved, [], 30.0, as_local)
    shown = view(loaded, 30.0)
    assert shown["buckets"][TRAINING] == 27.0 and shown["buckets"][PAUSED] == 0.0


def test_no_job_has_an_empty_ledger_that_loads_from_nothing():
    assert view(Ledger(), 10.0)["wall_s"] == 0.0
    assert view(ledger_record.from_saved(None, None, 10.0, as_local), 10.0)["training_share"] is None
    assert set(view(Ledger(), 0.0)["buckets"]) == set(BUCKETS)
