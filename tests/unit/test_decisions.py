"""decide(): the driver's decisions once a round has reported (Horovod's WorkerStateRegistry)."""

from __future__ import annotations

from elastic_control_plane.services.registry.decisions import decide
from elastic_control_plane.services.registry.reports import FAILURE, READY, SUCCESS, SlotReport


def report(rank: int, state: str, exit_code: int | None = None, reason: str = "", failed_order: int = 0) -> SlotReport:
    return SlotReport(
        rank=rank, state=state, pid=1000 + rank, exit_code=exit_code, reason=reason, failed_order=failed_order
    )


# -- success -------------------------------------------------------------------------------------


def test_any_success_means_succeed():
    reports = {("a", 0): report(0, SUCCESS, 0), ("a", 1): report(1, READY)}
    decision = decide(reports, resets=0, reset_limit=None)
    assert decision.action == "succeed"
    assert decision.exit_code == 0
    assert decision.blacklist == []


def test_success_wins_over_failures():
    reports = {("a", 0): report(0, FAILURE, 3), ("b", 0): report(1, SUCCESS, 0), ("c", 0): report(2, FAILURE, 4)}
    decision = decide(reports, resets=0, reset_limit=None)
    assert decision.action == "succeed"
    assert decision.exit_code == 0
    assert decision.blacklist == []


def test_success_wins_over_a_reached_reset_limit():
    reports = {("a", 0): report(0, SUCCESS, 0), ("b", 0): report(1, READY)}
    assert decide(reports, resets=5, reset_limit=5).action == "succeed"


# -- all failed ----------------------------------------------------------------------------------


def test_all_failed_means_fail_with_all_hosts_failed():
    reports = {
        ("a", 0): report(0, FAILURE, 3, "exited with 3", failed_order=1),
        ("b", 0): report(1, FAILURE, 7, "exited with 7", failed_order=2),
    }
    decision = decide(reports, resets=0, reset_limit=None)
    assert decision.action == "fail"
    assert "all hosts failed" in decision.reason
    assert decision.exit_code == 3
    assert decision.blacklist == []


def test_all_failed_exit_code_is_that_of_the_first_failure_in_time_not_rank_or_dict_order():
    reports = {
        ("a", 0): report(0, FAILURE, 4, failed_order=3),
        ("c", 0): report(2, FAILURE, 9, failed_order=2),
        ("b", 0): report(1, FAILURE, 5, failed_order=1),
    }
    assert decide(reports, resets=0, reset_limit=None).exit_code == 5


def test_all_failed_skips_failures_without_exit_code_for_the_exit_code():
    # the first failure was a lost host (no exit code); the next one exited 6
    reports = {
        ("a", 0): report(0, FAILURE, None, "host lost", failed_order=1),
        ("b", 0): report(1, FAILURE, 6, failed_order=2),
    }
    assert decide(reports, resets=0, reset_limit=None).exit_code == 6


def test_all_failed_without_any_exit_code_exits_one():
    reports = {
        ("a", 0): report(0, FAILURE, None, "host lost", failed_order=1),
        ("b", 0): report(1, FAILURE, None, "host lost", failed_order=2),
    }
    decision = decide(reports, resets=0, reset_limit=None)
    assert decision.action == "fail"
    assert decision.exit_code == 1


def test_all_failed_first_killed_by_signal_exits_one_not_negative():
    reports = {("a", 0): report(0, FAILURE, -9, failed_order=1), ("b", 0): report(1, FAILURE, 3, failed_order=2)}
    assert decide(reports, resets=0, reset_limit=None).exit_code == 1


def test_all_failed_reason_names_every_failure_in_rank_order():
    reports = {("b", 0): report(1, FAILURE, 2, "exited with 2"), ("a", 0): report(0, FAILURE, 1, "exited with 1")}
    reason = decide(reports, resets=0, reset_limit=None).reason
    assert reason.index("rank 0 on a exited with 1") < reason.index("rank 1 on b exited with 2")


def test_all_failed_wins_over_reset_limit():
    reports = {("a", 0): report(0, FAILURE, 2)}
    assert "all hosts failed" in decide(reports, resets=9, reset_limit=1).reason


# -- partial failure -----------------------------------------------------------------------------


def test_partial_failure_resumes_and_blacklists_exactly_the_failed_hosts():
    reports = {
        ("a", 0): report(0, READY),
        ("a", 1): report(1, READY),
        ("b", 0): report(2, FAILURE, 1),
        ("c", 0): report(3, READY),
        ("d", 0): report(4, FAILURE, None, "host lost"),
    }
    decision = decide(reports, resets=0, reset_limit=None)
    assert decision.action == "resume"
    assert decision.blacklist == ["b", "d"]


def test_partial_failure_blacklists_a_host_once_even_with_several_failed_slots():
    reports = {("a", 0): report(0, READY), ("b", 0): report(1, FAILURE, 1), ("b", 1): report(2, FAILURE, 1)}
    assert decide(reports, resets=0, reset_limit=None).blacklist == ["b"]


def test_partial_failure_on_one_slot_blacklists_the_whole_host():
    reports = {("a", 0): report(0, READY), ("b", 0): report(1, READY), ("b", 1): report(2, FAILURE, 1)}
    assert decide(reports, resets=0, reset_limit=None).blacklist == ["b"]


def test_partial_failure_reason_describes_the_failure():
    reports = {("a", 0): report(0, READY), ("b", 0): report(1, FAILURE, 1, "exited with 1")}
    assert "rank 1 on b exited with 1" in decide(reports, resets=0, reset_limit=None).reason


def test_partial_failure_under_the_reset_limit_resumes():
    reports = {("a", 0): report(0, READY), ("b", 0): report(1, FAILURE, 1)}
    assert decide(reports, resets=1, reset_limit=2).action == "resume"


# -- reset limit ---------------------------------------------------------------------------------


def test_reset_limit_reached_fails():
    reports = {("a", 0): report(0, READY), ("b", 0): report(1, FAILURE, 5, failed_order=1)}
    decision = decide(reports, resets=2, reset_limit=2)
    assert decision.action == "fail"
    assert "reset limit" in decision.reason
    assert decision.exit_code == 5
    assert decision.blacklist == []


def test_reset_limit_zero_fails_at_the_first_reset():
    reports = {("a", 0): report(0, READY), ("b", 0): report(1, READY)}
    decision = decide(reports, resets=0, reset_limit=0)
    assert decision.action == "fail"
    assert "reset limit" in decision.reason


def test_reset_limit_counts_host_changes_too():
    # Horovod counts every resume, not only failures: a READY-only round at the limit stops the job.
    reports = {("a", 0): report(0, READY), ("b", 0): report(1, READY)}
    decision = decide(reports, resets=3, reset_limit=3)
    assert decision.action == "fail"
    assert decision.exit_code == 1


def test_no_reset_limit_never_fails_on_resets():
    reports = {("a", 0): report(0, READY), ("b", 0): report(1, FAILURE, 1)}
    assert decide(reports, resets=10_000, reset_limit=None).action == "resume"


# -- ready only ----------------------------------------------------------------------------------


def test_ready_only_resumes_without_blacklist():
    reports = {("a", 0): report(0, READY), ("a", 1): report(1, READY), ("b", 0): report(2, READY)}
    decision = decide(reports, resets=0, reset_limit=None)
    assert decision.action == "resume"
    assert decision.blacklist == []
    assert decision.exit_code == 0


def test_a_crash_whose_agent_restarts_the_slot_resumes_without_blacklisting_its_host():
    reports = {
        ("a", 0): SlotReport(0, READY),
        ("b", 0): SlotReport(1, FAILURE, exit_code=-9, host_stays=True),
        ("c", 0): SlotReport(2, FAILURE, exit_code=1),
    }
    decision = decide(reports, resets=0, reset_limit=None)
    assert decision.action == "resume"
    assert decision.blacklist == ["c"]


def test_every_worker_crashing_with_no_snapshot_still_fails_the_job_even_when_their_slots_restart():
    reports = {
        ("a", 0): SlotReport(0, FAILURE, exit_code=-9, host_stays=True),
        ("b", 0): SlotReport(1, FAILURE, exit_code=-9, host_stays=True),
    }
    assert decide(reports, resets=0, reset_limit=None).action == "fail"


# -- every worker failed, with snapshots -----------------------------------------------------------


def all_crashed() -> dict:
    return {
        ("a", 0): SlotReport(0, FAILURE, exit_code=-9, host_stays=True),
        ("b", 0): SlotReport(1, FAILURE, exit_code=-9, host_stays=True),
    }


def test_every_worker_failing_resumes_from_the_newest_snapshot_as_a_reset():
    decision = decide(all_crashed(), resets=0, reset_limit=None, newest_snapshot=42)
    assert (decision.action, decision.resume_from, decision.blacklist) == ("resume", 42, [])
    assert decision.reason.startswith("every worker failed; resuming from the snapshot of commit 42")


def test_failing_again_with_no_commit_since_the_last_resume_stops_the_job():
    decision = decide(all_crashed(), resets=1, reset_limit=None, newest_snapshot=42, resumed_from=42)
    assert decision.action == "fail"
    assert "all hosts failed again at commit 42, with no commit since the last resume" in decision.reason


def test_progress_since_the_last_resume_allows_another():
    assert decide(all_crashed(), resets=1, reset_limit=None, newest_snapshot=50, resumed_from=42).resume_from == 50


def test_the_reset_limit_still_holds_for_a_resume_from_a_snapshot():
    decision = decide(all_crashed(), resets=3, reset_limit=3, newest_snapshot=42)
    assert decision.action == "fail" and "reset limit 3 reached" in decision.reason


def test_a_resume_from_a_snapshot_still_blacklists_hosts_that_do_not_stay():
    reports = {
        ("a", 0): SlotReport(0, FAILURE, exit_code=1),
        ("b", 0): SlotReport(1, FAILURE, exit_code=-9, host_stays=True),
    }
    decision = decide(reports, resets=0, reset_limit=None, newest_snapshot=7)
    assert (decision.action, decision.blacklist) == ("resume", ["a"])


def test_a_partial_failure_is_not_a_resume_from_a_snapshot():
    reports = {("a", 0): SlotReport(0, READY), ("b", 0): SlotReport(1, FAILURE, exit_code=-9, host_stays=True)}
    assert decide(reports, resets=0, reset_limit=None, newest_snapshot=7).resume_from == 0


def test_every_worker_failing_on_hosts_given_up_fails_as_in_horovod_even_with_a_snapshot():
    reports = {("a", 0): SlotReport(0, FAILURE, exit_code=1), ("b", 0): SlotReport(1, FAILURE, exit_code=1)}
    decision = decide(reports, resets=0, reset_limit=None, newest_snapshot=7)
    assert decision.action == "fail" and decision.reason.startswith("all hosts failed")


def test_in_torchrun_mode_every_worker_failing_is_a_restart_not_the_jobs_end() -> None:
    reports = {
        ("host-1", 0): SlotReport(rank=0, state=FAILURE, exit_code=1, failed_order=2, host_stays=True),
        ("host-2", 0): SlotReport(rank=1, state=FAILURE, exit_code=-9, failed_order=1, host_stays=True),
    }
    assert decide(reports, resets=0, reset_limit=None).action == "fail"
    assert decide(reports, resets=0, reset_limit=None, torchrun=True).action == "resume"
    assert decide(reports, resets=2, reset_limit=3, torchrun=True).action == "resume"
    assert decide(reports, resets=3, reset_limit=3, torchrun=True).action == "fail"


def test_in_torchrun_mode_a_change_of_hosts_is_not_counted_against_the_reset_limit() -> None:
    reports = {("host-1", 0): SlotReport(rank=0, state=READY), ("host-2", 0): SlotReport(rank=1, state=READY)}
    assert decide(reports, resets=0, reset_limit=0, torchrun=True).action == "resume"
    assert decide(reports, resets=0, reset_limit=0).action == "fail"
