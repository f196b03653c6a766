"""`libworker.elastic.waiting(reason, up_to=S)` (libworker/elastic/declared_waits.py): a context manager and a
decorator that declare a wait in the worker's record, nothing outside a job, and a clear error on bad arguments."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import libworker as hvd
from elastic_control_plane.slot_processes import wait_record
from elastic_control_plane.slot_processes.wait_record import NoRecord, RecordReader, WaitRecord
from libworker.world import world


@pytest.fixture
def reader(tmp_path: Path) -> Iterator[RecordReader]:
    """The worker's record as its agent reads it, with `world.waits` writing to it for the test's length."""
    path = str(tmp_path / "record")
    wait_record.create(path)
    world.waits = WaitRecord(path)
    try:
        yield RecordReader(path)
    finally:
        world.waits = NoRecord()


def test_a_declared_wait_is_in_the_record_while_it_lasts(reader: RecordReader) -> None:
    with hvd.elastic.waiting("downloading shard 7", up_to=600):
        during = reader.read()
    after = reader.read()
    assert during is not None and during.declared_reason == "downloading shard 7"
    assert time.monotonic() + 590 < during.declared_until <= time.monotonic() + 600
    assert after is not None and (after.declared_until, after.declared_reason) == (0.0, "")


def test_as_a_decorator_it_declares_every_call_and_ends_even_when_the_call_raises(reader: RecordReader) -> None:
    seen = []

    @hvd.elastic.waiting("preprocessing", up_to=30)
    def preprocess(fail: bool) -> None:
        state = reader.read()
        seen.append(None if state is None else state.declared_reason)
        if fail:
            raise RuntimeError("the user's error")

    preprocess(False)
    with pytest.raises(RuntimeError, match="the user's error"):
        preprocess(True)
    assert seen == ["preprocessing", "preprocessing"]
    state = reader.read()
    assert state is not None and state.declared_until == 0.0, "the declaration ends with the call"


def test_outside_a_job_it_does_nothing() -> None:
    assert isinstance(world.waits, NoRecord)
    with hvd.elastic.waiting("anything", up_to=1):
        pass


@pytest.mark.parametrize(
    ("reason", "up_to", "named"),
    [
        ("", 5, "reason"),
        ("  ", 5, "reason"),
        (3, 5, "reason"),
        ("x", 0, "up_to"),
        ("x", -1, "up_to"),
        ("x", float("inf"), "up_to"),
        ("x", True, "up_to"),
        ("x", "60", "up_to"),
    ],
)
def test_bad_arguments_are_refused_with_one_clear_line(reason: object, up_to: object, named: str) -> None:
    with pytest.raises(ValueError) as refused:
        hvd.elastic.waiting(reason, up_to=up_to)  # type: ignore[arg-type]
    assert f"{named} must be" in str(refused.value) and "\n" not in str(refused.value)
