"""Job: the registry's record of its job, saved and loaded by itself: back equal, across a restart whose clocks
read otherwise, from a file an earlier registry wrote; its rounds counted as resets or not; the round plan."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from elastic_control_plane.job.plan import JobPlan
from elastic_control_plane.job.spec import JobSpec
from elastic_control_plane.services.registry.decisions import Decision
from elastic_control_plane.services.registry.job import FAILED, HISTORY_KEPT, RUNNING_JOB, WAITING, Job, Now
from elastic_control_plane.services.registry.plan import round_plan
from elastic_control_plane.services.registry.reports import FAILURE, READY, RUNNING, SlotReport
from elastic_control_plane.services.registry.store import SqliteJobStore

SAVED_AT = Now(local=500.0, wall=1_700_000_000.0)
# The next registry, 60 s later on the wall clock, in a process whose monotonic clock reads otherwise.
LOADED_AT = Now(local=20.0, wall=1_700_000_060.0)

SPEC = JobSpec.parse({"command": ["python", "train.py"], "min_np": 2, "max_np": 4, "reset_limit": 3, "env": {"A": "1"}})

# What a registry saved of a job before the fields added since (`failure_resets`, `wait_calibration`, the spec's
# newer keys), to the letter: the record, and the parts beside it (the round, a row per host).
OLDER_JOB = {
    "exit_code": None,
    "failure_seen_at": None,
    "first_report_at": 1_699_999_990.0,
    "history": [{"action": "resume", "reason": "hosts changed", "round": 1}],
    "host_marks": {},
    "job_id": 3,
    "job_key": "9f321f4bd5314360",
    "reason": "",
    "resets": 1,
    "resumed_from": 0,
    "round": 2,
    "round_hosts_timestamp": 1_700_000_000.5,
    "snapshot_commits": {"host-1": 40},
    "spec": {
        "checkpoint_dir": None,
        "checkpoint_interval": 30.0,
        "command": ["python", "train.py"],
        "cooldown": [60.0, 600.0],
        "cwd": "",
        "discovery_script": None,
        "elastic_timeout": 600.0,
        "env": {"A": "1"},
        "hung_timeout": 120.0,
        "max_np": 4,
        "max_restarts": 3,
        "min_np": 2,
        "reset_limit": 3,
        "restart_window": 60.0,
    },
    "state": "running",
    "waiting_since": 1_699_999_980.0,
}
OLDER_PARTS = {
    "round": {
        "round_hosts": [["host-1", [0, 1]], ["host-2", [0]]],
        "agents": {"host-1": "agent:a", "host-2": "agent:b"},
        "retired_pids": [7, 8],
    },
    "reports/host-1": [[0, 0, "RUNNING", 101, None, "", 0, False], [1, 1, "READY", 102, None, "", 0, False]],
    "reports/host-2": [[0, 2, "FAILURE", 103, 1, "exited with code 1", 1, False]],
}


def running_job() -> Job:
    """A job in its second round: one worker running, one re-joined, one crashed."""
    job = Job.submitted(SPEC, 3, now=440.0)
    job.begin_round(
        1,
        [["host-1", [0, 1]], ["host-2", [0]]],
        1_699_999_900.0,
        {"host-1": "agent:a", "host-2": "agent:b"},
        replacing=False,
    )
    job.begin_round(
        2,
        [["host-1", [0, 1]], ["host-2", [0]]],
        1_700_000_000.5,
        {"host-1": "agent:a", "host-2": "agent:b"},
        replacing=False,
    )
    job.reports.record_started(("host-1", 0), 101)
    job.reports.record_rejoined(("host-1", 1), 102)
    job.reports.record_failure(("host-2", 0), "exited with code 1", pid=103, exit_code=1)
    job.note_report(490.0)
    job.note_failure(495.0)
    job.note_snapshot_commit("host-1", 40)
    job.host_marks = {"host-3": {"draining": True, "blacklisted": False, "until": None, "count": 0, "reason": ""}}
    job.wait_calibration = {"longest_wait_s": 0.4, "typical_busy_s": 1.25}
    return job


def through_json(job: Job, now: Now) -> tuple[dict, dict]:
    """What the store keeps of the job: its map and its parts, as JSON gives them back."""
    parts = {key: json.loads(text) for key, text in job.unsaved_parts(now).items() if text is not None}
    return json.loads(json.dumps(job.to_saved(now))), parts


def test_a_saved_job_loads_back_equal() -> None:
    job = running_job()
    saved, parts = through_json(job, SAVED_AT)
    assert Job.from_saved(saved, parts, SAVED_AT) == job


def test_instants_keep_their_age_across_a_restart() -> None:
    """An instant of the old process's clock is saved as wall-clock time and becomes one of the new process's clock
    that lies as far in the past (plus the time the registry was away)."""
    job = running_job()
    saved, parts = through_json(job, SAVED_AT)
    assert saved["first_report_at"] == 1_699_999_990.0, "10 s before the save, on the wall clock"
    loaded = Job.from_saved(saved, parts, LOADED_AT)
    away = LOADED_AT.wall - SAVED_AT.wall
    assert LOADED_AT.local - loaded.first_report_at == SAVED_AT.local - job.first_report_at + away
    assert LOADED_AT.local - loaded.waiting_since == SAVED_AT.local - job.waiting_since + away
    assert LOADED_AT.local - loaded.failure_seen_at == SAVED_AT.local - job.failure_seen_at + away
    shift = (LOADED_AT.local - SAVED_AT.local) - away
    moved = {
        "waiting_since": job.waiting_since + shift,
        "first_report_at": job.first_report_at + shift,
        "failure_seen_at": job.failure_seen_at + shift,
    }
    assert loaded == replace(job, **moved), "nothing else changes"


def test_a_job_saved_before_the_fields_added_since_loads() -> None:
    job = Job.from_saved(OLDER_JOB, OLDER_PARTS, SAVED_AT)
    assert (job.job_id, job.state, job.round, job.resets, job.spec) == (3, RUNNING_JOB, 2, 1, SPEC)
    assert job.reports[("host-2", 0)] == SlotReport(
        rank=2, state=FAILURE, pid=103, exit_code=1, reason="exited with code 1", failed_order=1
    )
    assert job.reports.counts()[RUNNING] == 1 and job.reports.counts()[READY] == 1
    assert list(job.reports.retired_pids) == [7, 8]
    assert (job.first_report_at, job.waiting_since, job.failure_seen_at) == (490.0, 480.0, None)
    newer_fields = {
        "run_id": "",
        "failure_resets": 0,
        "wait_calibration": {},
        "hang_doublings": {},
        "spec": {
            **OLDER_JOB["spec"],
            "mode": "horovod",
            "preload": [],
            "fork_server": True,
            "hang_detection": True,
            "probation_clean": 600.0,
        },
    }
    assert job.to_saved(SAVED_AT) == {**OLDER_JOB, **newer_fields}, (
        "and is saved again to the letter, with the fields it predates"
    )
    assert job.unsaved_parts(SAVED_AT) == {}, "its parts are saved already"
    job.reports.record_rejoined(("host-1", 0), 101)
    assert {key: json.loads(text) for key, text in job.unsaved_parts(SAVED_AT).items()} == {
        "reports/host-1": [[0, 0, "READY", 101, None, "", 0, False], OLDER_PARTS["reports/host-1"][1]]
    }, "a change saves its host's row, and nothing else"


def test_a_field_the_saved_map_lacks_takes_its_default() -> None:
    older = {key: value for key, value in OLDER_JOB.items() if key not in ("resumed_from", "snapshot_commits")}
    job = Job.from_saved(older, {}, SAVED_AT)
    assert (job.resumed_from, job.snapshot_commits, job.wait_calibration, len(job.reports)) == (0, {}, {}, 0)


def test_the_job_goes_through_the_store_and_back(tmp_path: Path) -> None:
    job = running_job()
    store = SqliteJobStore(tmp_path)
    parts = job.unsaved_parts(SAVED_AT)
    store.save({"job": job.to_saved(SAVED_AT)}, parts)
    job.saved(parts)
    store.close()
    loaded = SqliteJobStore(tmp_path).load()
    assert loaded is not None
    saved, saved_parts = loaded
    assert sorted(saved_parts) == ["ledger", "ledger_timeline", "reports/host-1", "reports/host-2", "round"]
    assert Job.from_saved(saved["job"], saved_parts, SAVED_AT) == job


def test_a_new_round_saves_every_row_and_drops_the_rows_of_hosts_it_left(tmp_path: Path) -> None:
    job = running_job()
    store = SqliteJobStore(tmp_path)
    for hosts in ([["host-1", [0, 1]], ["host-2", [0]]], [["host-1", [0, 1]], ["host-3", [0, 1]]]):
        job.begin_round(job.round + 1, hosts, 3.0, {}, replacing=False)
        parts = job.unsaved_parts(SAVED_AT)
        store.save({"job": job.to_saved(SAVED_AT)}, parts)
        job.saved(parts)
    assert parts["reports/host-2"] is None and parts["reports/host-3"] is not None
    assert job.unsaved_parts(SAVED_AT) == {}
    store.close()
    loaded = SqliteJobStore(tmp_path).load()
    assert loaded is not None
    assert sorted(loaded[1]) == ["ledger", "ledger_timeline", "reports/host-1", "reports/host-3", "round"]
    again = Job.from_saved(loaded[0]["job"], loaded[1], SAVED_AT)
    assert again == job and again.round_hosts == [["host-1", [0, 1]], ["host-3", [0, 1]]]


def test_instants_are_saved_to_the_millisecond_so_the_clocks_jitter_saves_nothing_new() -> None:
    job = running_job()
    jittered = Now(local=SAVED_AT.local, wall=SAVED_AT.wall + 0.00002)
    assert job.to_saved(jittered) == job.to_saved(SAVED_AT)


def test_no_job_saves_and_loads() -> None:
    saved, parts = through_json(Job(), SAVED_AT)
    assert Job.from_saved(saved, parts, SAVED_AT) == Job()


# -- rounds --------------------------------------------------------------------------------------


def test_rounds_after_the_first_are_resets_unless_they_replace_one_still_forming() -> None:
    job = Job.submitted(SPEC, 1, now=0.0)
    hosts = [["a", [0]], ["b", [0, 1]]]
    job.begin_round(1, hosts, 1.0, {}, replacing=False)
    assert (job.round, job.resets, job.state, len(job.reports)) == (1, 0, RUNNING_JOB, 3)
    job.begin_round(2, hosts, 2.0, {}, replacing=True)
    assert job.resets == 0
    job.wait_for_next_round(5.0)
    assert (job.state, job.waiting_since) == (WAITING, 5.0)
    job.begin_round(3, hosts, 3.0, {}, replacing=False)
    assert (job.round, job.resets, job.round_hosts_timestamp) == (3, 1, 3.0)
    assert [job.reports[slot].rank for slot in (("a", 0), ("b", 0), ("b", 1))] == [0, 1, 2]


def test_what_the_job_keeps_per_host_goes_with_the_host() -> None:
    """Hosts come and go by new names for weeks (a pod's name, a requeued allocation's nodes): a host's snapshot
    commit and its slots' hang doublings are kept while its agent lives, and no longer; the live ones' stay."""
    job = Job.submitted(SPEC, 1, now=0.0)
    for n in range(1, 1001):
        host, previous = f"host-{n}", f"host-{n - 1}"
        job.note_snapshot_commit(host, n)
        job.hang_doublings[f"{host}:0"] = [1, 100 + n]
        job.begin_round(n, [[host, [0]], ["stays", [0]]], float(n), {host: "i", "stays": "i", previous: "i"}, False)
    assert sorted(job.snapshot_commits) == ["host-1000", "host-999"]
    assert sorted(job.hang_doublings) == ["host-1000:0", "host-999:0"]
    job.note_snapshot_commit("stays", 7)
    job.begin_round(1001, [["stays", [0]]], 1001.0, {"stays": "i"}, False)
    assert job.snapshot_commits == {"stays": 7} and job.hang_doublings == {}


def test_recovery_runs_from_the_first_failure_until_a_round_is_released() -> None:
    job = Job.submitted(SPEC, 1, now=0.0)
    assert job.recovered(10.0) is None
    job.note_failure(12.0)
    job.note_failure(13.0)
    assert job.recovered(15.5) == 3.5
    assert job.recovered(16.0) is None


def test_history_keeps_the_newest_decisions() -> None:
    job = Job.submitted(SPEC, 1, now=0.0)
    for number in range(HISTORY_KEPT + 5):
        job.round = number
        job.note_decision(Decision("resume", f"round {number}"), float(number))
    assert len(job.history) == HISTORY_KEPT and job.history[0]["round"] == 5


def test_the_summary_answers_job() -> None:
    job = running_job()
    job.finish(FAILED, "cancelled", 130, 20.0)
    summary = job.summary()
    assert (summary["job"], summary["state"], summary["exit_code"], summary["size"], summary["spec"]) == (
        3,
        FAILED,
        130,
        3,
        SPEC.to_dict(),
    )


def test_the_round_plan_carries_the_round_and_the_job_plan() -> None:
    job = running_job()
    assert round_plan(job, size=3) == {
        "round": 2,
        "hosts": [["host-1", [0, 1]], ["host-2", [0]]],
        "size": 3,
        "job": 3,
        "job_key": job.job_key,
        "spec": SPEC.to_dict(),
    }


def test_a_host_reads_the_same_plan_from_a_round_event_and_from_the_job_reply() -> None:
    job = running_job()
    assert (
        JobPlan.from_wire(round_plan(job, size=3)) == JobPlan.from_wire(job.summary()) == JobPlan(3, job.job_key, SPEC)
    )
