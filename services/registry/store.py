"""JobStore: the registry's durable memory, as an interface; SqliteJobStore: one SQLite database (WAL,
synchronous=FULL) under `--state-dir`, the store the registry runs on (services/registry/__main__.py chooses it).

The registry saves what it must not forget (the job, its round and reports,
its resets and decisions, the host decisions it made through discovery, the
events not yet published) after every change and before it answers or
publishes what the change caused, in one transaction: a small state document,
and beside it the parts that grow with the job's size, each a record of its
own under its key (the round's hosts, and one per host for its reports:
`reports/<host>`). The caller hands over only the parts that changed (a
reset or a release changes every host's; a worker's exit one host's), and a
part given as None is deleted in the same transaction (a host that left the
round). A save whose state is unchanged and that has no part writes nothing.
A transaction that returned is on disk: a kill -9 of the registry, or a
reboot of its node, loses nothing it acknowledged. Loading reads the state
and every part.

A database that cannot be read is not replaced: `StoreError` names the file,
and the registry refuses to start rather than forget a running job. A
database of another schema version (version 1 kept the reports as one
document) is refused the same way.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

SCHEMA_VERSION = 2
DATABASE = "registry.sqlite3"
_UPSERT = "INSERT INTO {table} (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value"


class StoreError(RuntimeError):
    """The state directory or its database cannot be used; the message names it."""


class JobStore(Protocol):
    """What the registry needs of its durable memory: the last saved state with its parts, a save that is durable
    when it returns (the state if it changed, the parts given: JSON text, or None to delete one), what the last save
    that returned left (after one that raised: what the registry goes back to), and where the state is kept (for its
    log)."""

    where: str

    def load(self) -> tuple[dict[str, Any], dict[str, Any]] | None: ...

    def last_saved(self) -> tuple[dict[str, Any], dict[str, Any]] | None: ...

    def save(self, state: dict[str, Any], parts: Mapping[str, str | None] | None = None) -> bool: ...

    def close(self) -> None: ...


def _check_directory(path: Path, info: os.stat_result) -> None:
    """The state directory holds the job (the command every agent runs): this user's or root's, and not writable by
    everyone (group-writable passes: Kubernetes gives a pod's volume to its fsGroup so); else StoreError, one line."""
    if info.st_uid not in (os.getuid(), 0):
        raise StoreError(f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): its job is not used")
    if info.st_mode & 0o002:
        raise StoreError(f"everyone may write {path} (mode {stat.S_IMODE(info.st_mode):o}): chmod o-w it")


def _check_database(path: Path, info: os.stat_result) -> None:
    """The database itself: this user's, and no one else may write it."""
    if info.st_uid != os.getuid():
        raise StoreError(f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()}): its job is not used")
    if info.st_mode & 0o022:
        raise StoreError(f"others may write {path} (mode {stat.S_IMODE(info.st_mode):o}): chmod go-w it")


class SqliteJobStore:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DATABASE
        self.where = str(self.path)
        try:
            for directory in [*reversed(state_dir.parents), state_dir]:
                if not directory.exists():
                    directory.mkdir(mode=0o700)  # the job's spec (its environment) is the operator's only
            _check_directory(state_dir, state_dir.stat())
            # SQLite gives its -wal and -shm files this mode. Not through a symlink, and judged on the open file.
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                _check_database(self.path, os.fstat(fd))
            finally:
                os.close(fd)
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS registry (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            self._db.execute("CREATE TABLE IF NOT EXISTS parts (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            found = self._read("schema")
            if found is None:
                self._write("schema", json.dumps(SCHEMA_VERSION))
            elif json.loads(found) != SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: schema version {found}, this registry reads version {SCHEMA_VERSION} "
                    "(move the state directory away to start afresh)"
                )
        except (sqlite3.Error, OSError, ValueError) as exc:
            raise StoreError(f"cannot use the registry's state database {self.path}: {exc}") from None
        self._saved_state = self._read("state")

    def _read(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM registry WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _write(self, key: str, value: str) -> None:
        self._db.execute(_UPSERT.format(table="registry"), (key, value))

    def load(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """The last saved state and its parts (key: the part, parsed), or None for a new state directory."""
        if self._saved_state is None:
            return None
        state = self._parse("state", self._saved_state)
        if not isinstance(state, dict):
            raise StoreError(f"{self.path}: the saved state is not a map")
        try:
            rows = self._db.execute("SELECT key, value FROM parts").fetchall()
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read {self.path}: {exc}") from None
        return state, {str(key): self._parse(str(key), str(text)) for key, text in rows}

    def last_saved(self) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """What the last save that returned left: a refused save's transaction was rolled back, so the database."""
        return self.load()

    def _parse(self, key: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError as exc:
            raise StoreError(f"{self.path}: the saved {key} is not readable: {exc}") from None

    def save(self, state: dict[str, Any], parts: Mapping[str, str | None] | None = None) -> bool:
        """Write `state` if it differs from the last one written, and `parts` (key: JSON text, or None to delete
        the part), in one transaction; True when anything was written."""
        text = json.dumps(state, sort_keys=True, separators=(",", ":"))
        parts = parts or {}
        if text == self._saved_state and not parts:
            return False
        try:
            self._db.execute("BEGIN IMMEDIATE")
            if text != self._saved_state:
                self._write("state", text)
            self._db.executemany("DELETE FROM parts WHERE key = ?", [(k,) for k, v in parts.items() if v is None])
            self._db.executemany(_UPSERT.format(table="parts"), [(k, v) for k, v in parts.items() if v is not None])
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise StoreError(f"cannot save to {self.path}: {exc}") from None
        self._saved_state = text
        return True

    def close(self) -> None:
        self._db.close()
