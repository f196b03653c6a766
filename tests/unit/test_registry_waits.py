"""WaitBoard (services/registry/waits.py): hangs judged from the agents' `waits` reports (a rank the others wait for
while its process tree makes no progress: suspected at the limit, killed at the kill limit, or past the upper
bound), innocent pauses under the floor, declared waits, doubled limits for a slot hung again, the excuse from the
collective timeout, the calibrated limit, the cost of each rank to the others and
the stragglers it makes; bad reports refused at the door; only the current round's slots kept, and only its hosts'
metric series."""

from __future__ import annotations

from typing import Any

import prometheus_client
import pytest

from elastic_control_plane.bus.service import RequestError
from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.registry import metrics
from elastic_control_plane.services.registry.hang_limits import FLOOR_S, Limits, limits_of
from elastic_control_plane.services.registry.job import Job
from elastic_control_plane.services.registry.wait_rows import parse_waits
from elastic_control_plane.services.registry.waits import Kill, Seen, WaitBoard

SPEC = JobSpec.parse({"command": ["python", "train.py"], "min_np": 1, "hung_timeout": 120})
HOSTS = [["a", [0, 1]], ["b", [0, 1]]]  # ranks: a/0 is 0, a/1 is 1, b/0 is 2, b/1 is 3
FRESH_S = 3.0


def pid(host: str, local_rank: int) -> int:
    return 100 + 10 * (host == "b") + local_rank


def running_job(spec: JobSpec = SPEC) -> Job:
    job = Job.submitted(spec, 1, now=0.0)
    job.begin_round(1, HOSTS, 1.0, {}, replacing=False)
    for host, local_ranks in HOSTS:
        for local_rank in local_ranks:
            job.reports.record_started((host, local_rank), pid(host, local_rank))
    return job


def row(host: str, local_rank: int, **values: Any) -> dict[str, Any]:
    """A worker's row: past its first waits, neither waiting nor busy unless told."""
    return {
        "local_rank": local_rank,
        "pid": pid(host, local_rank),
        "round": 1,
        "waiting_s": None,
        "busy_s": None,
        "stalled_s": None,
        "waits": 10,
        "longest_wait_s": 0.0,
        "typical_busy_s": 0.0,
        "waited_total_s": 0.0,
        **values,
    }


def report(board: WaitBoard, job: Job, host: str, now: float, *rows: dict[str, Any]) -> Seen:
    reported_host, parsed = parse_waits({"host": host, "slots": list(rows)})
    return board.note(job, reported_host, parsed, now)


def stall(board: WaitBoard, job: Job, now: float, for_s: float, suspect_first: bool = True, **suspect: Any) -> Seen:
    """Rank 1 (a/1) busy with no progress for `for_s`; rank 2 (b/0) has waited 0.1 s longer for it: what both
    reports made, together."""
    stuck = {"busy_s": for_s, "stalled_s": for_s, **suspect}
    waiter = {"waiting_s": for_s + 0.1, "pid": pid("b", 0), "round": stuck.get("round", 1)}
    reports = [("a", row("a", 1, **stuck)), ("b", row("b", 0, **waiter))]
    first, second = reports if suspect_first else reports[::-1]
    seen = [report(board, job, host, now, body) for host, body in (first, second)]
    return Seen(
        seen[-1].limits,
        False,
        job_changed=any(s.job_changed for s in seen),
        excuse_s=seen[-1].excuse_s,
        suspects=seen[0].suspects + seen[1].suspects,
        kills=seen[0].kills + seen[1].kills,
    )


def deadlock(board: WaitBoard, job: Job, now: float, suspect_first: bool = True, **suspect: Any) -> list[Kill]:
    """Rank 1 stalled 40.1 s, past the kill limit at the floor (40 s): the kills."""
    return stall(board, job, now, 40.1, suspect_first, **suspect).kills


# -- hangs -----------------------------------------------------------------------------------------


def test_at_the_floor_a_rank_is_suspected_after_30_s_without_progress_and_killed_after_40_s() -> None:
    assert limits_of(SPEC, {}) == Limits(30.0, 40.0, 120.0)
    board, job = WaitBoard(FRESH_S), running_job()
    assert stall(board, job, 100.0, 29.5).suspects == [], "an ordinary pause: a sleep, a lock, a child that waits"
    seen = stall(board, job, 101.0, 30.5)
    assert seen.kills == [] and seen.suspects == [
        {
            "host": "a",
            "local_rank": 1,
            "pid": 101,
            "rank": 1,
            "reason": "suspected: the others waited 30.6s for rank 1 (limit 30.0s, no progress in its process tree "
            "for 30.5s); killed at 40.0s without progress",
            "kill_at_s": 40.0,
        }
    ]
    assert stall(board, job, 102.0, 31.5).suspects == [], "told once per stall"
    assert board.summary(job, 102.0)["suspected"] == [
        {"host": "a", "local_rank": 1, "rank": 1, "pid": 101, "stalled_s": 31.5, "kill_at_s": 40.0}
    ]
    report(board, job, "a", 103.0, row("a", 1, busy_s=32.5, stalled_s=0.2))
    assert board.summary(job, 103.0)["suspected"] == [], "it moved again"
    assert stall(board, job, 134.0, 30.5).suspects != [], "a later stall is a new suspicion"


@pytest.mark.parametrize("suspect_first", [True, False])
def test_a_deadlocked_rank_that_others_wait_for_is_killed_with_a_stack_dump(suspect_first: bool) -> None:
    kills = deadlock(WaitBoard(FRESH_S), running_job(), 100.0, suspect_first)
    assert [(kill.event, kill.rank, kill.first) for kill in kills] == [
        (
            {
                "host": "a",
                "local_rank": 1,
                "pid": 101,
                "reason": "hung: the others waited 40.2s for rank 1 (limit 40.0s, no progress in its process tree "
                "for 40.1s); its slot's next limits double (killed at 80s)",
                "dump_stack": True,
            },
            1,
            True,
        )
    ]


def test_a_rank_stopped_inside_a_collective_is_judged_like_a_deadlock_and_named_stopped() -> None:
    """Its agent saw it stopped (a signal or a debugger) while its record said it waits, like the others': a look of
    a debugger under the limit is spared; stopped past the kill limit, it is killed, and the reason says stopped."""
    board, job = WaitBoard(FRESH_S), running_job()
    assert stall(board, job, 100.0, 29.5, stopped=True).suspects == [], "a debugger's look, under the limit"
    assert board.summary(job, 100.5)["stopped"] == [{"host": "a", "local_rank": 1, "rank": 1, "stopped_s": 30.0}]
    report(board, job, "a", 101.0, row("a", 1, waiting_s=0.2))  # continued: it waits with the others again
    (kill,) = deadlock(board, job, 200.0, stopped=True)
    assert kill.event["reason"].startswith(
        "hung: the others waited 40.2s for rank 1 (limit 40.0s, stopped inside a collective (by a signal or a "
        "debugger) for 40.1s)"
    ), kill.event


def test_rows_are_judged_as_they_stand_now_not_as_they_were_sent() -> None:
    """The suspect's report crossed 40 s a moment before the waiter's: when the waiter's report comes, 0.4 s later,
    the suspect's stall has gone on since its report, and it is killed then, not three heartbeats later."""
    board, job = WaitBoard(FRESH_S), running_job()
    stall(board, job, 100.0, 35.0)
    assert report(board, job, "a", 104.7, row("a", 1, busy_s=39.7, stalled_s=39.7)).kills == []
    seen = report(board, job, "b", 105.1, row("b", 0, waiting_s=40.2))
    assert [kill.rank for kill in seen.kills] == [1]
    assert "no progress in its process tree for 40.1s" in seen.kills[0].event["reason"]


def restart_in_place(job: Job, number: int, new_pid: int) -> None:
    """The job's next round, `number`, in which a/1 runs the worker `new_pid`."""
    job.begin_round(number, HOSTS, float(number), {}, replacing=False)
    for host, local_ranks in HOSTS:
        for local_rank in local_ranks:
            job.reports.record_started(
                (host, local_rank), new_pid if (host, local_rank) == ("a", 1) else pid(host, local_rank)
            )


def test_a_slot_hung_again_after_its_restart_gets_doubled_limits_never_past_the_upper_bound() -> None:
    """A first batch that takes 65 s without progress in every life: killed once at 40 s, then given 80 s."""
    board, job = WaitBoard(FRESH_S), running_job()
    assert stall(board, job, 100.0, 40.1).job_changed and job.hang_doublings == {"a:1": [1, 101]}
    restart_in_place(job, 2, 201)
    again = stall(board, job, 200.0, 65.0, pid=201, round=2)
    assert again.kills == [] and [s["kill_at_s"] for s in again.suspects] == [80.0]
    assert "limits doubled 1x after its earlier hangs" in again.suspects[0]["reason"]
    killed = stall(board, job, 300.0, 80.1, pid=201, round=2).kills
    assert [kill.event["pid"] for kill in killed] == [201] and job.hang_doublings == {"a:1": [2, 201]}
    assert "killed at 120s" in killed[0].event["reason"], "the next limit stops at the hung timeout"
    restart_in_place(job, 3, 301)
    assert [kill.event["pid"] for kill in stall(board, job, 400.0, 120.1, pid=301, round=3).kills] == [301]
    assert job.hang_doublings == {"a:1": [2, 201]}, "no doubling past the upper bound"
    restart_in_place(job, 4, 401)
    assert report(board, job, "a", 500.0, row("a", 1, pid=401, round=4, waits=1000)).job_changed
    assert job.hang_doublings == {}, "a worker that trained a thousand waits clears the slot's doublings"


def test_a_rank_that_makes_progress_is_hung_only_past_the_upper_bound() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    assert deadlock(board, job, 100.0, stalled_s=0.5) == [], "its process tree computes or writes"
    assert stall(board, job, 101.0, 119.0, stalled_s=None).suspects == []
    seen = report(board, job, "a", 102.0, row("a", 1, busy_s=121.0, stalled_s=1.0))
    assert [kill.event["reason"] for kill in seen.kills] == [
        "hung: the others waited 120.1s for rank 1 (upper bound 120s, busy for 121.0s)"
    ], "the waiter's wait went on for the second since its report"


def test_a_declared_wait_is_never_judged_and_excuses_the_others() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    declared = {"busy_s": None, "stalled_s": None, "declared_s": 300.0, "declared": "downloading shard 7"}
    report(board, job, "a", 100.0, row("a", 1, **declared))
    seen = report(board, job, "b", 100.0, row("b", 0, waiting_s=500.0))
    assert (seen.kills, seen.suspects, seen.excuse_s) == ([], [], FRESH_S)
    assert board.summary(job, 101.0)["declared"] == [
        {"host": "a", "local_rank": 1, "rank": 1, "reason": "downloading shard 7", "left_s": 299.0}
    ]


def test_the_others_are_excused_from_the_collective_timeout_only_while_someone_is_judged() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    everyone_waits = [report(board, job, h, 100.0, row(h, 0, waiting_s=70.0), row(h, 1, waiting_s=70.0)) for h in "ab"]
    assert [seen.excuse_s for seen in everyone_waits] == [0.0, 0.0], "a wait nobody accounts for times out"
    assert report(board, job, "a", 101.0, row("a", 1, busy_s=70.0, stalled_s=0.0)).excuse_s == FRESH_S
    assert report(board, job, "b", 101.0 + FRESH_S + 0.5, row("b", 0, waiting_s=75.0)).excuse_s == 0.0, "stale"
    starting = report(board, job, "a", 106.0, row("a", 1, busy_s=None, waits=0))
    assert starting.excuse_s == 0.0, "a rank before its first wait is not judged: the timeout bounds the wait"


def test_a_rank_in_its_first_waits_of_a_round_is_no_suspect_and_hung_only_past_the_upper_bound() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    assert stall(board, job, 100.0, 119.0, waits=2).kills == [], "the others load or compile"
    assert stall(board, job, 100.0, 119.0, waits=2).suspects == []
    assert [kill.event["pid"] for kill in stall(board, job, 101.0, 120.5, waits=2).kills] == [101]


@pytest.mark.parametrize("stale", ["suspect", "waiter"])
def test_a_stale_report_is_never_judged(stale: str) -> None:
    """An agent silent for three heartbeats is a lost host, discovery's to handle."""
    board, job = WaitBoard(FRESH_S), running_job()
    suspect, waiter = ("a", row("a", 1, busy_s=90.0, stalled_s=90.0)), ("b", row("b", 0, waiting_s=90.0))
    first, second = (suspect, waiter) if stale == "suspect" else (waiter, suspect)
    report(board, job, first[0], 100.0, first[1])
    seen = report(board, job, second[0], 100.0 + FRESH_S + 0.5, second[1])
    assert (seen.kills, seen.suspects) == ([], [])


def test_a_pause_of_every_rank_is_never_a_hang() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    paused = {"busy_s": 600.0, "stalled_s": 600.0}
    seen = [report(board, job, host, 100.0, row(host, 0, **paused), row(host, 1, **paused)) for host in ("a", "b")]
    assert [(s.kills, s.suspects) for s in seen] == [([], []), ([], [])], "nobody waits for anybody"


def test_long_waits_raise_the_limit_above_the_floor() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    seen = report(board, job, "b", 101.0, row("b", 0, busy_s=0.1, longest_wait_s=8.0, waited_total_s=8.0))
    assert seen.limits is not None and (seen.limits.limit_s, seen.limits.kill_s) == (40.0, pytest.approx(53.33, 0.01))
    assert (seen.job_changed, seen.limits, job.wait_calibration) == (
        True,
        limits_of(SPEC, {"longest_wait_s": 8.0}),
        {"longest_wait_s": 8.0},
    )
    assert stall(board, job, 102.0, 35.0).suspects == [], "35 s is now under the limit"
    assert report(board, job, "b", 103.0, row("b", 0, busy_s=0.1, longest_wait_s=1.0)).job_changed is False


def test_the_limits_never_exceed_the_hung_timeout() -> None:
    short = JobSpec.parse({"command": ["python", "train.py"], "hung_timeout": 20})
    assert limits_of(short, {"longest_wait_s": 10.0, "typical_busy_s": 1.0}) == Limits(20.0, 20.0, 20.0)
    assert limits_of(SPEC, {"typical_busy_s": 9.0}) == Limits(45.0, 60.0, 120.0), "the typical busy time counts too"
    assert limits_of(JobSpec.parse({"command": ["x"], "hung_timeout": 2}), {}) == Limits(2.0, 2.0, 2.0)


def test_the_kill_is_sent_again_only_after_ten_seconds_while_the_same_worker_reports() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    assert len(deadlock(board, job, 100.0)) == 1
    assert [deadlock(board, job, now) for now in (101.0, 105.0, 109.9)] == [[], [], []]
    again = deadlock(board, job, 110.0)
    assert [(kill.event["pid"], kill.first) for kill in again] == [(101, False)], "in case the event was lost"
    assert job.hang_doublings == {"a:1": [1, 101]}, "a resend doubles nothing"


def test_reports_of_a_worker_that_is_not_the_rounds_or_has_failed_are_not_judged() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    assert deadlock(board, job, 100.0, pid=999) == [], "not the pid the round has for the slot"
    assert deadlock(board, job, 101.0, round=0) == [], "a report of an earlier round"
    job.reports.record_failure(("a", 1), "exited with code 1", exit_code=1)
    assert deadlock(board, job, 102.0) == [], "its exit is already recorded"


def test_a_job_without_hang_detection_is_told_no_limits_and_never_judged() -> None:
    job = running_job(JobSpec.parse({"command": ["python", "train.py"], "hang_detection": False}))
    board = WaitBoard(FRESH_S)
    assert deadlock(board, job, 100.0) == []
    seen = report(board, job, "b", 101.0, row("b", 0, longest_wait_s=2.0))
    assert (seen.limits, seen.job_changed, job.wait_calibration) == (None, False, {})
    assert seen.reply() == {"limit_s": None, "kill_s": None, "upper_s": None, "excuse_s": 0.0}


def test_the_floor_is_the_limit_until_waits_are_seen() -> None:
    seen = report(WaitBoard(FRESH_S), running_job(), "a", 100.0, row("a", 0))
    assert (seen.limits, seen.job_changed) == (Limits(limit_s=FLOOR_S, kill_s=40.0, upper_s=120.0), False)


# -- what each rank costs the others -------------------------------------------------------------


def test_a_slower_rank_costs_the_others_most_and_becomes_a_straggler_once_per_episode() -> None:
    """Rank 3 (b/1) computes 20% longer than the others, which wait 1/6 of their time for it."""
    board, job = WaitBoard(FRESH_S), running_job()
    waited = {slot: 0.0 for slot in (("a", 0), ("a", 1), ("b", 0), ("b", 1))}
    stragglers, lost_on = [], {"a": 0.0, "b": 0.0}

    def second(now: float, slow: bool) -> None:
        for slot in waited:
            waited[slot] += 0.0 if slot == ("b", 1) and slow else 1 / 6
        for host in ("a", "b"):
            rows = [row(host, i, busy_s=0.1, waited_total_s=waited[(host, i)]) for i in (0, 1)]
            seen = report(board, job, host, now, *rows)
            stragglers.extend(seen.stragglers)
            for name, seconds in seen.waited_for.items():
                lost_on[name] += seconds

    for now in range(100, 141):
        second(float(now), slow=True)
    assert stragglers == [{"host": "b", "local_rank": 1, "rank": 3, "lost_s_per_min": 10.0}], "after 30 s, once"
    summary = board.summary(job, 140.0)
    assert summary["ranks"] == [{"host": "b", "local_rank": 1, "rank": 3, "lost_s_per_min": 10.0, "lost_s": 6.7}]
    assert lost_on["a"] == 0.0 and lost_on["b"] == pytest.approx(40 / 6)
    for now in range(141, 161):
        second(float(now), slow=False)
    assert board.summary(job, 160.0)["ranks"][0]["lost_s_per_min"] < 6.0, "it caught up"
    for now in range(161, 215):
        second(float(now), slow=True)
    assert len(stragglers) == 2, "a new episode"


def test_the_first_report_of_a_worker_only_sets_its_baseline() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    seen = report(board, job, "a", 100.0, row("a", 0, waited_total_s=500.0), row("a", 1, waited_total_s=0.0))
    assert seen.waited_for == {}, "no interval yet: nothing waited is counted"


def test_a_new_round_drops_the_slots_it_left_out() -> None:
    board, job = WaitBoard(FRESH_S), running_job()
    report(board, job, "a", 100.0, row("a", 0), row("a", 1))
    report(board, job, "b", 100.0, row("b", 0), row("b", 1))
    assert len(board) == 4
    job.begin_round(2, [["a", [0, 1]]], 2.0, {}, replacing=False)
    job.reports.record_started(("a", 0), pid("a", 0))
    seen = report(board, job, "a", 101.0, row("a", 0, round=2))
    assert (seen.new_round, len(board)) == (True, 2), "b's slots are gone; a/1 has no worker in the round yet"
    assert report(board, job, "a", 102.0, row("a", 0, round=2)).new_round is False


# -- at the door -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"slots": []}, "'host'"),
        ({"host": "a", "slots": {}}, "'slots'"),
        ({"host": "a", "slots": [3]}, "slots[0] must be a map"),
        ({"host": "a", "slots": [{**row("a", 0), "local_rank": True}]}, "slots[0].local_rank"),
        ({"host": "a", "slots": [row("a", 0), row("a", 1, pid=-1)]}, "slots[1].pid"),
        ({"host": "a", "slots": [row("a", 0, waits=1.5)]}, "slots[0].waits"),
        ({"host": "a", "slots": [row("a", 0, waiting_s="1")]}, "slots[0].waiting_s"),
        ({"host": "a", "slots": [row("a", 0, busy_s=-1.0)]}, "slots[0].busy_s"),
        ({"host": "a", "slots": [row("a", 0, stalled_s=False)]}, "slots[0].stalled_s"),
        ({"host": "a", "slots": [row("a", 0, longest_wait_s=None)]}, "slots[0].longest_wait_s"),
        ({"host": "a", "slots": [row("a", 0, waited_total_s=float("nan"))]}, "slots[0].waited_total_s"),
        ({"host": "a", "slots": [{k: v for k, v in row("a", 0).items() if k != "typical_busy_s"}]}, "typical_busy_s"),
        ({"host": "a", "slots": [row("a", 0, declared_s=-1.0)]}, "slots[0].declared_s"),
        ({"host": "a", "slots": [row("a", 0, declared_s=5.0, declared=7)]}, "slots[0].declared"),
        ({"host": "a", "slots": [row("a", 0, stopped="yes")]}, "slots[0].stopped"),
    ],
)
def test_a_bad_report_is_refused_with_one_line_naming_the_field(body: dict[str, Any], named: str) -> None:
    with pytest.raises(RequestError) as refused:
        parse_waits(body)
    assert refused.value.code == "bad_request" and named in refused.value.message
    assert "\n" not in refused.value.message


def test_the_waited_for_series_of_a_host_goes_when_a_round_goes_on_without_it() -> None:
    metrics.waited_for({"gone-host": 1.5, "kept-host": 2.0})
    metrics.keep_hosts(["kept-host"])
    value = prometheus_client.REGISTRY.get_sample_value
    assert value("elastic_worker_waited_for_seconds_total", {"host": "gone-host"}) is None
    assert value("elastic_worker_waited_for_seconds_total", {"host": "kept-host"}) == 2.0
    metrics.keep_hosts([])


def test_the_longest_live_wait_dates_a_fault_the_others_stalled_on() -> None:
    """An agent killed with its workers is found seconds later; the others have waited for its rank since."""
    job, board = running_job(), WaitBoard(FRESH_S)
    assert board.longest_wait(job, 10.0) is None, "no rank reports: not known"
    report(board, job, "a", 10.0, row("a", 0, waiting_s=1.5), row("a", 1, busy_s=0.1))
    report(board, job, "b", 10.5, row("b", 0, waiting_s=0.6), row("b", 1, waiting_s=0.05))
    assert board.longest_wait(job, 11.0) == pytest.approx(2.5), "a/0's wait goes on since its report"
    job.reports.record_failure(("a", 0), "exited with code 1", pid=pid("a", 0), exit_code=1)
    assert board.longest_wait(job, 11.0) == pytest.approx(1.1), "a slot that failed no longer counts"
    assert board.longest_wait(job, 11.2) == 0.0, "b/0's 0.6 s wait, reported 0.7 s ago, has most likely ended"
    assert board.longest_wait(job, 20.0) is None, "every report is stale"
