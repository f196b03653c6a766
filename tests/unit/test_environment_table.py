"""docs/environment.md lists every ELASTIC_* variable the product reads, and nothing else: the names spelled in the
code (a variable's name, a click option's `envvar`), the intervals of `Timing` and the endpoints of `Endpoints`."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from elastic_control_plane.bus.config import Endpoints, Timing

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("agent", "bus", "services", "slot_processes", "libworker", "elasticctl", "snapshot", "replication")


def read_by_the_code() -> set[str]:
    names = {f"ELASTIC_{f.name.upper()}" for f in fields(Timing)}
    names |= {f"ELASTIC_{f.name.upper()}_ENDPOINT" for f in fields(Endpoints)}
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            names |= set(re.findall(r"[\"'](ELASTIC_[A-Z_]+)[\"']", path.read_text()))
    return names


def test_the_table_lists_every_variable_the_code_reads_and_no_other() -> None:
    table = (ROOT / "docs" / "environment.md").read_text()
    listed = set(re.findall(r"^\| `(ELASTIC_[A-Z_]+)` \|", table, re.M))
    code = read_by_the_code()
    assert not code - listed, f"read by the code, missing from docs/environment.md: {sorted(code - listed)}"
    assert not listed - code, f"in docs/environment.md, read by nothing: {sorted(listed - code)}"
