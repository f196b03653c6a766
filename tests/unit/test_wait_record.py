"""The wait record both ends read and write (slot_processes/wait_record.py), declared waits and the agent's excuse in
it, a process tree's progress as the agent samples it (agent/process_tree.py), the stack dump a hung worker answers
with, and when and what the agent reports (agent/wait_watch.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog

from elastic_control_plane.agent import process_tree
from elastic_control_plane.agent.gpu_activity import GpuActivity
from elastic_control_plane.agent.intervals import INTERVALS
from elastic_control_plane.agent.wait_watch import WaitWatch, progressed
from elastic_control_plane.agent.workers import Worker, reap
from elastic_control_plane.bus.envelope import Message
from elastic_control_plane.slot_processes import wait_record
from elastic_control_plane.slot_processes.wait_record import (
    IGNORED_WAITS,
    NoRecord,
    RecordReader,
    WaitRecord,
    record_from_env,
)
from testing.harness import wait_for


@pytest.fixture
def record_path(tmp_path: Path) -> str:
    path = str(tmp_path / "record")
    wait_record.create(path)
    return path


def test_a_fresh_record_reads_as_nothing_yet(record_path: str) -> None:
    state = RecordReader(record_path).read()
    assert state is not None and (state.round, state.waits, state.waiting_since, state.busy_since) == (0, 0, 0.0, 0.0)


def test_a_wait_is_seen_while_it_lasts_and_counted_once_it_ends(record_path: str) -> None:
    record, reader = WaitRecord(record_path), RecordReader(record_path)
    record.begin_round(7)
    with record.waiting():
        with record.waiting():  # a negotiation cycle inside the wait for its request: one wait
            during = reader.read()
        time.sleep(0.02)
    after = reader.read()
    assert during is not None and during.waiting_since > 0 and during.round == 7
    assert after is not None and after.waiting_since == 0.0 and after.busy_since > during.waiting_since
    assert after.waits == 1 and after.waited_total >= 0.02


def test_the_first_waits_of_a_round_joins_and_aborted_waits_do_not_calibrate(record_path: str) -> None:
    record, reader = WaitRecord(record_path), RecordReader(record_path)
    record.begin_round(1)
    for _ in range(IGNORED_WAITS):
        with record.waiting():
            time.sleep(0.03)  # a round's first collectives wait for a rank that restores its state
    state = reader.read()
    assert state is not None and state.longest_wait == 0.0 and state.waits == IGNORED_WAITS
    with record.waiting(calibrates=False):
        time.sleep(0.03)  # Horovod's join: this rank is out of data while the others train
    with pytest.raises(RuntimeError), record.waiting():
        time.sleep(0.03)
        raise RuntimeError("aborted by the control plane: the rank it waited for hung")
    with record.waiting():
        time.sleep(0.03)
        record.discount()  # a collective no other rank submitted, given up at the timeout
    with record.waiting():
        time.sleep(0.005)
    state = reader.read()
    assert state is not None and 0.005 <= state.longest_wait < 0.03
    record.begin_round(2)
    state = reader.read()
    assert state is not None and (state.round, state.waits, state.longest_wait, state.busy_since) == (2, 0, 0.0, 0.0)
    assert state.waited_total >= 6 * 0.03, "the life total goes on across rounds"


def test_one_long_busy_stretch_barely_moves_the_typical_interval(record_path: str) -> None:
    record, reader = WaitRecord(record_path), RecordReader(record_path)
    record.begin_round(1)
    for _ in range(IGNORED_WAITS + 6):
        with record.waiting():
            pass
        time.sleep(0.01)
    typical = reader.read().typical_busy  # type: ignore[union-attr]
    time.sleep(0.3)  # an evaluation on every rank
    with record.waiting():
        pass
    after = reader.read().typical_busy  # type: ignore[union-attr]
    assert 0.009 <= typical < 0.05 and after < 1.2 * typical


def test_a_worker_no_agent_started_records_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(wait_record.RECORD_ENV, raising=False)
    assert isinstance(record_from_env(), NoRecord)
    monkeypatch.setenv(wait_record.RECORD_ENV, str(tmp_path / "gone"))
    record = record_from_env()
    assert isinstance(record, NoRecord)
    with record.waiting():
        record.begin_round(1)


HANGS = """
import ctypes, os, sys
from elastic_control_plane.slot_processes import wait_record

def stuck_in_native_code():
    while True:
        ctypes.PyDLL(None).sleep(1000)  # holds the GIL; a signal's handler ends one sleep, not the wait

wait_record.answer_stack_dumps()
print("ready", flush=True)
stuck_in_native_code()
"""


def test_a_worker_holding_the_gil_in_native_code_answers_the_stack_dump_and_makes_no_progress(tmp_path: Path) -> None:
    stack_file = tmp_path / "stack"
    stack_file.touch()
    env = {**os.environ, wait_record.STACK_ENV: str(stack_file)}
    process = subprocess.Popen([sys.executable, "-c", HANGS], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        assert not tree_progressed(process.pid, 0.3)
        os.kill(process.pid, wait_record.STACK_DUMP_SIGNAL)
        wait_for(lambda: "stuck_in_native_code" in stack_file.read_text(), 10, "the stack in the dump file")
        assert process.poll() is None, "the dump does not end the process"
    finally:
        process.kill()
        process.wait()


def tree_progressed(root: int, seconds: float) -> bool:
    """Did the tree rooted at `root` make progress over `seconds`, as the agent samples it?"""
    before = process_tree.tree_used(root)
    time.sleep(seconds)
    after = process_tree.tree_used(root)
    assert before is not None and after is not None
    return progressed(process_tree.progress(before, after), seconds)


def test_a_spinning_process_makes_progress(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert tree_progressed(process.pid, 0.5)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


# A worker that waits in its own code while what it started runs: a child (`subprocess.run`), or a grandchild under
# a shell, that computes or sleeps. The worker itself uses no CPU.
WAITS_ON = """
import subprocess, sys
print("ready", flush=True)
subprocess.run(sys.argv[1:])
"""
COMPUTES = [sys.executable, "-c", "while True: pass"]


@pytest.mark.parametrize(
    ("started", "makes_progress"),
    [
        (COMPUTES, True),
        (["sh", "-c", f"{sys.executable} -c 'while True: pass'; true"], True),  # a grandchild computes
        (["sleep", "30"], False),  # a child that waits: only time tells it from a deadlock
    ],
    ids=["child-computes", "grandchild-computes", "child-waits"],
)
def test_a_trees_progress_counts_its_descendants(started: list[str], makes_progress: bool) -> None:
    worker = subprocess.Popen([sys.executable, "-c", WAITS_ON, *started], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "ready\n"
        wait_for(
            lambda: len(process_tree.tree_used(worker.pid) or {}) >= (3 if started[0] == "sh" else 2), 10, "its tree"
        )
        root_only = process_tree.process_used(worker.pid)
        assert tree_progressed(worker.pid, 0.5) is makes_progress
        alone = process_tree.process_used(worker.pid)
        assert root_only is not None and alone is not None and alone[1].cpu_ticks - root_only[1].cpu_ticks <= 5, (
            "the worker itself does nothing: the progress is its descendants'"
        )
    finally:
        for key in process_tree.tree_used(worker.pid) or {}:
            os.kill(key[0], signal.SIGKILL)
        worker.wait()


PREPARES_DATA = """
import subprocess, sys, time
print("ready", flush=True)
sys.stdin.readline()
subprocess.run([sys.executable, "-c", "import time\\nwhile time.process_time() < 0.4: pass"])
print("prepared", flush=True)
time.sleep(30)
"""


def test_a_child_that_computed_and_exited_between_samples_counts() -> None:
    """Its time moves into the worker's own counters once reaped (cutime): a short data-preparation step."""
    worker = subprocess.Popen(
        [sys.executable, "-c", PREPARES_DATA], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "ready\n"
        before = process_tree.tree_used(worker.pid)
        assert worker.stdin is not None
        worker.stdin.write("go\n")
        worker.stdin.flush()
        assert worker.stdout.readline() == "prepared\n"
        after = process_tree.tree_used(worker.pid)
        assert before is not None and after is not None and len(after) == 1, "the child is gone"
        assert process_tree.progress(before, after).cpu_seconds >= 0.2
    finally:
        worker.kill()
        worker.wait()


def test_a_tree_is_read_to_a_bound() -> None:
    assert process_tree.tree_used(2**22 + 7) is None, "a process that is gone"
    assert process_tree.descendants_readable(), "this kernel lists children (CONFIG_PROC_CHILDREN)"


def test_without_nvml_the_gpu_activity_is_unavailable_and_says_why() -> None:
    gpus = GpuActivity("libnvidia-ml-not-here.so.1")
    assert not gpus.available and "not found" in gpus.reason and gpus.busy_pids() == set()


# -- declared waits and the agent's excuse ---------------------------------------------------------


def test_a_declared_wait_is_seen_with_its_reason_and_restarts_the_busy_time_when_it_ends(record_path: str) -> None:
    record, reader = WaitRecord(record_path), RecordReader(record_path)
    record.begin_round(1)
    with record.waiting():
        pass
    before = reader.read()
    record.declare("downloading shard 7", 60.0)
    record.declare("x" * 200, 5.0)  # nested, with a reason longer than the record keeps
    inner = reader.read()
    record.end_declared()
    outer = reader.read()
    record.end_declared()
    after = reader.read()
    assert before is not None and inner is not None and outer is not None and after is not None
    assert inner.declared_reason == "x" * wait_record.REASON_BYTES
    assert inner.declared_until == outer.declared_until >= time.monotonic() + 59, "until the latest end"
    assert outer.declared_reason == "downloading shard 7"
    assert (after.declared_until, after.declared_reason) == (0.0, "")
    assert after.busy_since > before.busy_since, "busy again from the declaration's end"


def test_the_agents_excuse_lets_the_worker_wait_past_the_timeout_until_it_runs_out(record_path: str) -> None:
    record, reader = WaitRecord(record_path), RecordReader(record_path)
    assert not record.excused()
    reader.excuse(time.monotonic() + 0.3)
    assert record.excused()
    wait_for(lambda: not record.excused(), 5, "the excuse to run out")
    assert not NoRecord().excused(), "a worker no agent watches always has the collective timeout"


class Registry:
    """Where WaitWatch sends its reports: each is kept, and answered with the limits given."""

    def __init__(self, limits: dict[str, Any]) -> None:
        self.sent: list[dict[str, Any]] = []
        self.limits = limits

    def send(self, msg_type: str, body: dict[str, Any], on_reply: Any, **_: Any) -> None:
        assert msg_type == "waits"
        self.sent.append(body)
        on_reply(Message(type="waits", body=self.limits))


class OneWorker:
    """The agent's WaitWatch over one worker, as the agent calls it every tick and heartbeat."""

    def __init__(self, watch: WaitWatch, worker: Worker) -> None:
        self.watch, self.worker = watch, worker

    def tick(self) -> None:
        self.watch.tick([self.worker])

    def report(self) -> None:
        self.watch.report([self.worker])


@contextlib.contextmanager
def watched_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limits: dict[str, Any]
) -> Iterator[tuple[OneWorker, Registry, WaitRecord]]:
    """A WaitWatch whose registry answers `limits`, watching one worker (a sleeping process) in round 1; the worker
    is reaped at the end as the keeper reaps it."""
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(tmp_path))
    registry = Registry(limits)
    commits = {"commit": 7, "age_s": 0.5, "saving_s": 0.25}
    watch = WaitWatch("host-1", registry, 1.0, structlog.get_logger())  # type: ignore[arg-type]
    watch.progress = lambda: commits
    files = watch.new_files()
    assert files is not None
    worker = Worker(0, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))  # type: ignore[arg-type]
    try:
        watch.watch(worker, files)
        record = WaitRecord(files.record)
        record.begin_round(1)
        yield OneWorker(watch, worker), registry, record
    finally:
        worker.process.kill()
        worker.process.wait()
        assert [exited for exited, _ in reap({0: worker})] == [worker]


def test_the_agent_reports_at_once_when_a_worker_crosses_a_limit_and_not_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with watched_worker(tmp_path, monkeypatch, {"limit_s": 0.2, "upper_s": 5.0}) as (watch, registry, record):
        watch.report()
        assert [row["round"] for row in registry.sent[-1]["slots"]] == [1] and len(registry.sent) == 1
        assert registry.sent[-1]["commit"] == {"commit": 7, "age_s": 0.5, "saving_s": 0.25}  # for the goodput ledger
        record.__enter__()  # the worker waits for the others
        wait_for(lambda: watch.tick() or len(registry.sent) == 2, 5, "a report once the wait passed the limit")
        assert registry.sent[-1]["slots"][0]["waiting_s"] >= 0.2
        for _ in range(3):
            watch.tick()
        assert len(registry.sent) == 2, "a limit crossed is reported once"
        record.__exit__(None)
    assert not list(tmp_path.glob("elastic-*")), "the worker's files go with it"


def test_the_agent_reports_a_declared_wait_not_as_busy_and_writes_the_registrys_excuse(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = {"limit_s": 30.0, "kill_s": 40.0, "upper_s": 120.0, "excuse_s": 3.0}
    with watched_worker(tmp_path, monkeypatch, limits) as (watch, registry, record):
        with record.waiting():
            pass
        record.declare("fetching the next shard", 90.0)
        watch.report()
        (row,) = registry.sent[-1]["slots"]
        assert (row["busy_s"], row["stalled_s"], row["declared"]) == (None, None, "fetching the next shard")
        assert 89.0 < row["declared_s"] <= 90.0
        assert record.excused(), "the reply's excuse is in the worker's record"
        record.end_declared()
        watch.report()
        (row,) = registry.sent[-1]["slots"]
        assert row["declared"] is None and row["busy_s"] is not None and row["busy_s"] < 1.0


def test_a_worker_stopped_inside_a_wait_is_reported_stalled_since_seen_stopped_and_waiting_again_once_continued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's record says it waits when one of them is stopped inside the collective: its agent looks at the
    process (once its wait has lasted a second) and reports it as the one the others wait for."""
    limits = {"limit_s": 30.0, "kill_s": 40.0, "upper_s": 120.0}
    with watched_worker(tmp_path, monkeypatch, limits) as (watch, registry, record):
        record.__enter__()

        def waited_two_looks() -> bool:
            watch.report()
            return registry.sent[-1]["slots"][0]["waiting_s"] > 2 * INTERVALS.sample_every

        wait_for(waited_two_looks, 10, "a wait of two looks")
        assert not registry.sent[-1]["slots"][0]["stopped"], "a running waiter waits"
        os.kill(watch.worker.pid, signal.SIGSTOP)
        wait_for(lambda: watch.report() or registry.sent[-1]["slots"][0]["stopped"], 5, "the stop seen")
        (row,) = registry.sent[-1]["slots"]
        assert row["waiting_s"] is None and row["busy_s"] == row["stalled_s"] < INTERVALS.sample_every + 0.5, row
        os.kill(watch.worker.pid, signal.SIGCONT)
        wait_for(lambda: watch.report() or not registry.sent[-1]["slots"][0]["stopped"], 5, "continued")
        assert registry.sent[-1]["slots"][0]["waiting_s"] > INTERVALS.sample_every, "in the same wait again"
        record.__exit__(None)
