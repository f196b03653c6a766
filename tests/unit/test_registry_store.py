"""SqliteJobStore (the registry's JobStore): the saved state survives a new process; an unchanged state is not
written again; a database it cannot read is refused with its path, not replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.registry.store import DATABASE, SqliteJobStore, StoreError


def test_saved_state_is_what_a_new_store_loads(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path / "state")
    assert store.load() is None
    state = {"last_job_id": 3, "job": {"round": 4, "reports": [{"host": "a", "local_rank": 0}]}}
    assert store.save(state) is True
    assert store.save(dict(state)) is False, "an unchanged state is not written again"
    store.close()
    again = SqliteJobStore(tmp_path / "state")
    assert again.load() == state
    assert again.save(state) is False
    again.close()


def test_a_database_that_is_not_one_is_refused_naming_it(tmp_path: Path) -> None:
    tmp_path.joinpath(DATABASE).write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match=DATABASE):
        SqliteJobStore(tmp_path)


def test_another_schema_version_is_refused(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path)
    store._write("schema", "99")
    store.close()
    with pytest.raises(StoreError, match="schema version 99"):
        SqliteJobStore(tmp_path)


def test_a_state_directory_that_cannot_be_made_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StoreError, match="cannot use"):
        SqliteJobStore(blocker / "state")


def test_the_state_is_the_operator_s_only(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path / "run" / "state" / "registry")
    store.save({"job": {"spec": {"env": {"TOKEN": "secret"}}}})
    for directory in (tmp_path / "run", tmp_path / "run" / "state", tmp_path / "run" / "state" / "registry"):
        assert directory.stat().st_mode & 0o077 == 0, directory
    for path in (tmp_path / "run" / "state" / "registry").iterdir():
        assert path.stat().st_mode & 0o077 == 0, path
    store.close()
