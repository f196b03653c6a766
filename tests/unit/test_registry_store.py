"""SqliteJobStore (the registry's JobStore): the saved state and its parts survive a new process; an unchanged state
is not written again; parts are written and deleted with the state; a database it cannot read, or of another schema,
is refused with its path, not replaced."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_control_plane.services.registry.store import DATABASE, SqliteJobStore, StoreError


def test_saved_state_is_what_a_new_store_loads(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path / "state")
    assert store.load() is None
    state = {"last_job_id": 3, "job": {"round": 4}}
    assert store.save(state) is True
    assert store.save(dict(state)) is False, "an unchanged state is not written again"
    store.close()
    again = SqliteJobStore(tmp_path / "state")
    assert again.load() == (state, {})
    assert again.save(state) is False
    again.close()


def test_parts_are_written_as_given_and_deleted_in_the_same_transaction(tmp_path: Path) -> None:
    store = SqliteJobStore(tmp_path)
    state = {"job": {"round": 1}}
    assert store.save(state, {"reports/a": "[[0]]", "reports/b": "[[1]]"}) is True
    assert store.save(state, {"reports/b": '[[1, "FAILURE"]]'}) is True, "a changed part with an unchanged state"
    assert store.save({"job": {"round": 2}}, {"reports/a": None, "reports/c": "[]"}) is True
    store.close()
    again = SqliteJobStore(tmp_path)
    assert again.load() == ({"job": {"round": 2}}, {"reports/b": [[1, "FAILURE"]], "reports/c": []})
    again.close()


def test_a_database_that_is_not_one_is_refused_naming_it(tmp_path: Path) -> None:
    tmp_path.joinpath(DATABASE).write_bytes(b"not a database at all" * 100)
    with pytest.raises(StoreError, match=DATABASE):
        SqliteJobStore(tmp_path)


@pytest.mark.parametrize("version", [1, 99])
def test_another_schema_version_is_refused(tmp_path: Path, version: int) -> None:
    """Version 1 kept the reports as one document: its database is refused in one line, not misread."""
    store = SqliteJobStore(tmp_path)
    store._write("schema", str(version))
    store.close()
    with pytest.raises(StoreError, match=f"schema version {version}, this registry reads version 2") as refused:
        SqliteJobStore(tmp_path)
    assert "\n" not in str(refused.value)


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


def test_a_state_directory_or_database_others_may_write_is_refused_and_a_private_one_used(tmp_path: Path) -> None:
    """The database holds the job, whose command every agent runs (issue 58): it is used only where it is the user's
    alone, never through a symlink."""
    private = tmp_path / "private"
    SqliteJobStore(private).close()
    assert (private / DATABASE).exists(), "the innocent case: a new, private state directory"
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(StoreError, match="everyone may write"):
        SqliteJobStore(shared)
    planted = tmp_path / "planted"
    planted.mkdir(mode=0o700)
    (planted / DATABASE).symlink_to(private / DATABASE)
    with pytest.raises(StoreError, match="cannot use the registry's state database"):
        SqliteJobStore(planted)
    (private / DATABASE).chmod(0o666)
    with pytest.raises(StoreError, match="others may write"):
        SqliteJobStore(private)
