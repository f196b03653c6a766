"""The wait record both ends read and write (slot_processes/wait_record.py), a process's progress as the agent samples
it, the stack dump a hung worker answers with, and when the agent reports (agent/wait_watch.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import structlog

from agent.wait_watch import WaitWatch, _progressed, process_progress
from agent.workers import Worker
from bus.envelope import Message
from slot_processes import wait_record
from slot_processes.wait_record import IGNORED_WAITS, NoRecord, RecordReader, WaitRecord, record_from_env
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
from slot_processes import wait_record

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
        before = process_progress(process.pid)
        time.sleep(0.3)
        after = process_progress(process.pid)
        assert before is not None and after is not None and not _progressed(before, after, 0.3)
        os.kill(process.pid, wait_record.STACK_DUMP_SIGNAL)
        wait_for(lambda: "stuck_in_native_code" in stack_file.read_text(), 10, "the stack in the dump file")
        assert process.poll() is None, "the dump does not end the process"
    finally:
        process.kill()
        process.wait()


def test_a_spinning_process_makes_progress(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        before = process_progress(process.pid)
        time.sleep(0.5)
        after = process_progress(process.pid)
        assert before is not None and after is not None and _progressed(before, after, 0.5)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


class Registry:
    """Where WaitWatch sends its reports: each is kept, and answered with the limits given."""

    def __init__(self, limits: dict[str, float]) -> None:
        self.sent: list[dict[str, Any]] = []
        self.limits = limits

    def send(self, msg_type: str, body: dict[str, Any], on_reply: Any, **_: Any) -> None:
        assert msg_type == "waits"
        self.sent.append(body)
        on_reply(Message(type="waits", body=self.limits))


def test_the_agent_reports_at_once_when_a_worker_crosses_a_limit_and_not_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(tmp_path))
    registry = Registry({"limit_s": 0.2, "upper_s": 5.0})
    watch = WaitWatch("host-1", registry, 1.0, structlog.get_logger())  # type: ignore[arg-type]
    files = watch.new_files()
    assert files is not None
    worker = Worker(0, subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]))  # type: ignore[arg-type]
    try:
        watch.watch(worker, files)
        record = WaitRecord(files.record)
        record.begin_round(1)
        watch.report()
        assert [row["round"] for row in registry.sent[-1]["slots"]] == [1] and len(registry.sent) == 1
        record.__enter__()  # the worker waits for the others
        wait_for(lambda: watch.tick() or len(registry.sent) == 2, 5, "a report once the wait passed the limit")
        assert registry.sent[-1]["slots"][0]["waiting_s"] >= 0.2
        for _ in range(3):
            watch.tick()
        assert len(registry.sent) == 2, "a limit crossed is reported once"
        record.__exit__(None)
        watch.forget(worker.pid)
        assert not list(tmp_path.glob("elastic-*")), "the worker's files go with it"
    finally:
        worker.process.kill()
        worker.process.wait()
