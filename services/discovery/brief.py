"""The brief host list's generations: the registry asks for the brief list every tick, with the generation it holds,
and is sent the list again only when it changed."""

from __future__ import annotations

from typing import Any


class BriefGenerations:
    """Numbers the brief host lists given out by one discovery incarnation."""

    def __init__(self, incarnation: str) -> None:
        self.incarnation = incarnation
        self._last: dict[str, Any] = {}  # the brief list last given out, less its clocks
        self._generation = 0

    def answer(self, brief: dict[str, Any], unless: Any) -> dict[str, Any]:
        """The brief list with its generation, or that it is unchanged when the asker has it (`unless`): 275 KB to
        decode at 4,096 hosts, ten times a second. Clocks (lost for, cooldown left) do not make a new list."""
        timeless = {**brief, "marked": [{**row, "lost_for": None, "cooldown_left": None} for row in brief["marked"]]}
        if timeless != self._last:
            self._last, self._generation = timeless, self._generation + 1
        generation = [self.incarnation, self._generation]
        if unless == generation:
            return {"unchanged": True, "generation": generation}
        return {**brief, "generation": generation}
