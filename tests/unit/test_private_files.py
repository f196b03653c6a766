"""Files only their owner can touch (issue 46): the run directory is the user's own and private (where it is by
default, made 0700, refused in one line when it is a symlink or open to others; someone else's is tested with a real
second user: tests/integration/test_local_privacy.py), and a name planted where the agent makes its shared-memory
files is never followed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastic_control_plane.bus.config import default_run_dir
from elastic_control_plane.bus.sockets import SecurityError, private_dir
from elastic_control_plane.slot_processes import wait_record
from elastic_control_plane.snapshot import layout


def test_the_run_directory_is_elastic_run_dir_else_the_users_runtime_directory_else_tmp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ELASTIC_RUN_DIR", "/somewhere/run")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_run_dir() == Path("/somewhere/run")
    monkeypatch.delenv("ELASTIC_RUN_DIR")
    assert default_run_dir() == Path("/run/user/1000/elastic")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_run_dir() == Path(f"/tmp/elastic-{os.getuid()}")


def test_a_missing_run_directory_is_made_private(tmp_path: Path) -> None:
    made = private_dir(tmp_path / "a" / "run", "ELASTIC_RUN_DIR")
    assert made.is_dir() and made.stat().st_mode & 0o777 == 0o700
    assert private_dir(made, "ELASTIC_RUN_DIR") == made, "one of the user's own, private, is taken as it is"


def test_a_run_directory_open_to_others_or_a_symlink_is_refused_in_one_line(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    shared.chmod(0o777)
    with pytest.raises(SecurityError, match=r"is open to others \(mode 777\): chmod 700 it, or set ELASTIC_RUN_DIR"):
        private_dir(shared, "ELASTIC_RUN_DIR")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(SecurityError, match=r"is not a directory \(a symlink\?\)"):
        private_dir(link, "ELASTIC_RUN_DIR")


def test_a_file_planted_where_the_agent_makes_its_shared_memory_files_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"the user's own data")
    prefix = str(tmp_path / "elastic-snapshot-1-host-1-0123456789abcdef")
    for path in layout.buffer_paths(prefix):
        Path(path).symlink_to(victim)
    layout.create(prefix)  # the planted links are removed, not followed
    for path in layout.buffer_paths(prefix):
        assert not Path(path).is_symlink() and Path(path).stat().st_mode & 0o777 == 0o600
    record = tmp_path / "elastic-waits-1-host-1-0123456789abcdef"
    record.symlink_to(victim)
    with pytest.raises(FileExistsError):
        wait_record.create(str(record))
    assert victim.read_bytes() == b"the user's own data"
