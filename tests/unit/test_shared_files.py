"""The agent's files in a shared directory (/dev/shm) are found by owner before name: another user's file, a name
whose pid is out of range, or a symlink is skipped, never fatal (issue 58: one file another user touched stopped every
agent on the machine from starting); this user's orphans of a dead agent are still removed, a live agent's kept."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import structlog

from elastic_control_plane.agent.snapshots import _BUFFER_NAME, SnapshotKeeper, remove_orphans

NOBODY = 65534


def dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


@pytest.fixture
def shared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory like /dev/shm: everyone may write, the sticky bit set."""
    directory = tmp_path / "shm"
    directory.mkdir()
    directory.chmod(0o1777)
    monkeypatch.setenv("ELASTIC_SHM_DIR", str(directory))
    return directory


def test_a_pid_out_of_range_is_skipped_and_said(shared: Path) -> None:
    planted = shared / "elastic-snapshot-99999999999999999999-x-y.0"
    planted.touch()
    with structlog.testing.capture_logs() as logs:
        remove_orphans(shared, _BUFFER_NAME, "snapshot_orphan_removed", structlog.get_logger())
    assert planted.exists()
    assert [entry["event"] for entry in logs] == ["shared_file_skipped"] and "out of range" in logs[0]["reason"]


@pytest.mark.skipif(os.geteuid() != 0, reason="making a file another user's takes root (CI runs as root)")
def test_another_users_file_is_left_alone(shared: Path) -> None:
    theirs = shared / f"elastic-snapshot-{dead_pid()}-x-y.0"
    theirs.touch()
    os.chown(theirs, NOBODY, NOBODY)
    with structlog.testing.capture_logs() as logs:
        remove_orphans(shared, _BUFFER_NAME, "snapshot_orphan_removed", structlog.get_logger())
    assert theirs.exists() and logs == []


def test_a_symlink_is_not_followed_nor_removed(shared: Path, tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_text("keep me")
    link = shared / f"elastic-snapshot-{dead_pid()}-x-y.0"
    link.symlink_to(target)
    remove_orphans(shared, _BUFFER_NAME, "snapshot_orphan_removed", structlog.get_logger())
    assert link.is_symlink() and target.read_text() == "keep me"


def test_this_users_orphans_go_and_a_live_agents_files_stay(shared: Path) -> None:
    orphan = shared / f"elastic-snapshot-{dead_pid()}-host-1-abc.0"
    live = shared / f"elastic-snapshot-{os.getpid()}-host-1-abc.1"
    for path in (orphan, live):
        path.touch()
    with structlog.testing.capture_logs() as logs:
        remove_orphans(shared, _BUFFER_NAME, "snapshot_orphan_removed", structlog.get_logger())
    assert not orphan.exists() and live.exists()
    assert [entry["event"] for entry in logs] == ["snapshot_orphan_removed"]


def test_an_agent_starts_beside_every_planted_file(shared: Path, tmp_path: Path) -> None:
    """The attack of the issue, whole: the agent's snapshot keeper starts in a directory holding all of the above."""
    (shared / "elastic-snapshot-99999999999999999999-x-y.0").touch()
    (shared / f"elastic-snapshot-{dead_pid()}-x-y.1").symlink_to(tmp_path)
    (shared / "elastic-snapshot-notapid-x-y.0").touch()
    if os.geteuid() == 0:
        theirs = shared / f"elastic-waits-{dead_pid()}-x"
        theirs.touch()
        os.chown(theirs, NOBODY, NOBODY)
    keeper = SnapshotKeeper("host-1", structlog.get_logger())
    assert keeper.directory == shared
