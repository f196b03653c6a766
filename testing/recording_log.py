"""RecordingLog: a logger that keeps the events it is given, with their fields, for tests that assert on what a
component said (and how often) without parsing process output."""

from __future__ import annotations

from typing import Any


class RecordingLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.events.append((event, fields))

    def names(self) -> list[str]:
        return [event for event, _ in self.events]
