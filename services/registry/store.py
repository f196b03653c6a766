"""JobStore: the registry's durable memory, as an interface; SqliteJobStore: one SQLite database (WAL,
synchronous=FULL) under `--state-dir`, the store the registry runs on (services/registry/__main__.py chooses it).

The registry saves one JSON document, the whole of what it must not forget
(the job, its round and reports, its resets and decisions, the host decisions
it made through discovery, the events not yet published), after every change
and before it answers or publishes what the change caused. A transaction that
returned is on disk: a kill -9 of the registry, or a reboot of its node, loses
nothing it acknowledged. A save that changes nothing writes nothing.

Parts that grow with the job's size (a report per worker: 32,768 of them on
4,096 hosts x 8) are handed over already serialized and kept in rows of their
own, written in the same transaction when they changed: the caller serializes
such a part only when it changed, not on every save.

A database that cannot be read is not replaced: `StoreError` names the file,
and the registry refuses to start rather than forget a running job.
"""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path
from typing import Any, Protocol

SCHEMA_VERSION = 1
DATABASE = "registry.sqlite3"


class StoreError(RuntimeError):
    """The state directory or its database cannot be used; the message names it."""


class JobStore(Protocol):
    """What the registry needs of its durable memory: the last saved state, a save that is durable when it returns
    (only what changed is written), and where the state is kept (for its log)."""

    where: str

    def load(self, parts: tuple[str, ...] = ()) -> dict[str, Any] | None: ...

    def save(self, state: dict[str, Any], parts: dict[str, str] | None = None) -> bool: ...

    def close(self) -> None: ...


class SqliteJobStore:
    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / DATABASE
        self.where = str(self.path)
        try:
            for directory in [*reversed(state_dir.parents), state_dir]:
                if not directory.exists():
                    directory.mkdir(mode=0o700)  # the job's spec (its environment) is the operator's only
            os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))  # SQLite gives its -wal, -shm files this mode
            self._db = sqlite3.connect(self.path, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("CREATE TABLE IF NOT EXISTS registry (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            found = self._read("schema")
            if found is None:
                self._write("schema", json.dumps(SCHEMA_VERSION))
            elif json.loads(found) != SCHEMA_VERSION:
                raise StoreError(f"{self.path}: schema version {found}, this registry reads version {SCHEMA_VERSION}")
        except (sqlite3.Error, OSError, ValueError) as exc:
            raise StoreError(f"cannot use the registry's state database {self.path}: {exc}") from None
        self._saved: dict[str, str | None] = {"state": self._read("state")}

    def _read(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM registry WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _write(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO registry (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (key, value),
        )

    def load(self, parts: tuple[str, ...] = ()) -> dict[str, Any] | None:
        """The last saved state with the `parts` saved beside it (each under its key, None if never saved), or None
        for a new state directory."""
        if self._saved["state"] is None:
            return None
        state = self._parse("state", self._saved["state"])
        if not isinstance(state, dict):
            raise StoreError(f"{self.path}: the saved state is not a map")
        loaded = {}
        for key in parts:
            self._saved[key] = self._read(key)
            loaded[key] = self._parse(key, self._saved[key])
        return {**state, **loaded}

    def _parse(self, key: str, text: str | None) -> Any:
        try:
            return None if text is None else json.loads(text)
        except ValueError as exc:
            raise StoreError(f"{self.path}: the saved {key} is not readable: {exc}") from None

    def save(self, state: dict[str, Any], parts: dict[str, str] | None = None) -> bool:
        """Write `state` and the `parts` (key: JSON text) that differ from the last ones written, in one
        transaction; True when anything was written."""
        texts = {"state": json.dumps(state, sort_keys=True, separators=(",", ":")), **(parts or {})}
        changed = {key: text for key, text in texts.items() if text != self._saved.get(key)}
        if not changed:
            return False
        try:
            self._db.execute("BEGIN IMMEDIATE")
            for key, text in changed.items():
                self._write(key, text)
            self._db.execute("COMMIT")
        except sqlite3.Error as exc:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            raise StoreError(f"cannot save to {self.path}: {exc}") from None
        self._saved.update(changed)
        return True

    def close(self) -> None:
        self._db.close()
