"""A job that ends while its host drains (a preemption: the last worker's SIGTERM judged before the drain's own
flush) writes the newest commit to --checkpoint-dir before its snapshot buffers go (agent/snapshots.py); a job that
ends otherwise does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from elastic_control_plane.agent import snapshots


def test_ending_a_job_while_draining_flushes_before_the_buffers_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(tmp_path))
    done: list[str] = []
    monkeypatch.setattr(snapshots.SnapshotKeeper, "flush_now", lambda self: done.append("flush"))
    monkeypatch.setattr(snapshots.layout, "remove", lambda prefix: done.append("remove"))
    keeper = snapshots.SnapshotKeeper("node1", structlog.get_logger())
    keeper.end_job(flush=True)
    assert done == ["flush", "remove"]
    done.clear()
    keeper.end_job()
    assert done == ["remove"]
