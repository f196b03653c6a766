"""`elasticctl` finds a running `elasticctl local`'s keys only in directories that are its user's alone (issue 58):
keys planted in a run directory others may enter, or reached through a symlink, are never presented."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastic_control_plane.bus.sockets import generate_keys
from elastic_control_plane.elasticctl.local_keys import LOCAL_KEYS, OWNER, live_local_keys


def keys_of_a_live_run(run_dir: Path) -> Path:
    keys = run_dir / LOCAL_KEYS
    keys.mkdir(mode=0o700, parents=True)
    run_dir.chmod(0o700)
    generate_keys(keys)
    (keys / OWNER).write_text(str(os.getpid()))
    return keys


def test_the_users_own_private_keys_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = keys_of_a_live_run(tmp_path / "run")
    monkeypatch.setenv("ELASTIC_RUN_DIR", str(tmp_path / "run"))
    assert live_local_keys() == keys


def test_keys_in_a_run_directory_others_may_enter_are_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys_of_a_live_run(tmp_path / "run")
    (tmp_path / "run").chmod(0o777)
    monkeypatch.setenv("ELASTIC_RUN_DIR", str(tmp_path / "run"))
    assert live_local_keys() is None


def test_keys_reached_through_a_symlink_are_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys_of_a_live_run(tmp_path / "elsewhere")
    (tmp_path / "run").mkdir(mode=0o700)
    (tmp_path / "run" / LOCAL_KEYS).symlink_to(tmp_path / "elsewhere" / LOCAL_KEYS)
    monkeypatch.setenv("ELASTIC_RUN_DIR", str(tmp_path / "run"))
    assert live_local_keys() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user takes root (CI runs as root)")
def test_keys_in_another_users_directory_are_not(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = keys_of_a_live_run(tmp_path / "run")
    os.chown(keys, 65534, 65534)
    monkeypatch.setenv("ELASTIC_RUN_DIR", str(tmp_path / "run"))
    assert live_local_keys() is None
