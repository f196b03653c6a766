"""ReportTable: what each slot of the job's current round has reported, kept by the one object that may change it.

A slot's report moves PENDING (assigned, no rank yet) -> RUNNING (its worker
has its rank) -> READY (it re-joined for the next round), SUCCESS (exit 0) or
FAILURE (a non-zero exit, its host lost, its agent restarted, hung). The table
owns:

- a `SlotReport` per slot, in rank order, looked up by slot in O(1);
- the slots by state, so "has every slot reported", "how many failed" and
  "which slots are silent" are answered without a scan (32,768 slots on 4,096
  hosts x 8);
- the order in which slots failed (each failure's `failed_order`; the first
  failure's exit code is the job's);
- the pids of earlier rounds' workers, to tell a leftover's exit from the
  exit of a current worker that has not re-joined yet;
- which hosts' reports changed since they were last saved: the table is saved
  as one row per host (`unsaved_rows`: only the hosts that changed, and the
  hosts of an earlier round whose rows must go), so a change to one slot
  writes its host's row, not 32,768 reports.

A `SlotReport` is an immutable tuple, made anew for each change (cheaper than
copying a dataclass: a round's release changes every slot); a change goes
through a method of the table, which keeps the states, the failure order and
the unsaved hosts true.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

PENDING, RUNNING, READY, SUCCESS, FAILURE = "PENDING", "RUNNING", "READY", "SUCCESS", "FAILURE"
STATES = (PENDING, RUNNING, READY, SUCCESS, FAILURE)
SILENT = (PENDING, RUNNING)
RETIRED_PIDS_KEPT = 4096  # pids of earlier rounds' workers, to tell a leftover's exit from a current worker's
ROW_FIELDS = ("local_rank", "rank", "state", "pid", "exit_code", "reason", "failed_order", "host_stays")  # a saved slot

Slot = tuple[str, int]


class SlotReport(NamedTuple):
    rank: int
    state: str = PENDING
    pid: int | None = None
    exit_code: int | None = None
    reason: str = ""
    failed_order: int = 0
    host_stays: bool = False

    def describe(self, slot: Slot) -> str:
        return f"rank {self.rank} on {slot[0]} {self.reason}"


class ReportTable:
    def __init__(self, reports: Mapping[Slot, SlotReport] | None = None, retired_pids: Iterable[int] = ()) -> None:
        """A table of `reports` (in rank order), none of them saved yet."""
        self._reports: dict[Slot, SlotReport] = {}
        self._by_state: dict[str, dict[Slot, None]] = {state: {} for state in STATES}
        self.retired_pids: dict[int, None] = dict.fromkeys(retired_pids)
        self._local_ranks: dict[str, list[int]] = {}  # host: the local ranks of its slots in the round, in rank order
        self._unsaved: dict[str, None] = {}  # hosts whose reports changed since their row was saved
        self._saved_hosts: set[str] = set()  # hosts that have a saved row
        self._dropped: set[str] = set()  # hosts with a saved row that the round no longer has
        self._fill(reports or {})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReportTable):
            return NotImplemented
        return self._reports == other._reports and list(self.retired_pids) == list(other.retired_pids)

    __hash__ = None  # type: ignore[assignment]  # a table changes

    def __repr__(self) -> str:
        return f"ReportTable({self._reports!r}, retired_pids={list(self.retired_pids)!r})"

    # -- questions: by slot and by state without a scan; the listings walk the slots --------------
    def __len__(self) -> int:
        return len(self._reports)

    def __getitem__(self, slot: Slot) -> SlotReport:
        return self._reports[slot]

    @property
    def reports(self) -> Mapping[Slot, SlotReport]:
        """Every slot's report, in rank order, read-only (for `decisions.decide`)."""
        return MappingProxyType(self._reports)

    def count(self, state: str) -> int:
        return len(self._by_state[state])

    def counts(self) -> dict[str, int]:
        return {state: len(slots) for state, slots in self._by_state.items()}

    def all_reported(self) -> bool:
        """The round's barrier: every slot is READY, SUCCESS or FAILURE (a round of no slots never is)."""
        return bool(self._reports) and not any(self._by_state[state] for state in SILENT)

    def silent(self) -> list[Slot]:
        """The slots that have not reported yet (PENDING or RUNNING)."""
        return [*self._by_state[PENDING], *self._by_state[RUNNING]]

    def failures(self) -> Iterator[tuple[Slot, SlotReport]]:
        """The failed slots and their reports, in the order they failed."""
        return ((slot, self._reports[slot]) for slot in self._by_state[FAILURE])

    def failures_on(self, hosts: Iterable[str]) -> dict[str, list[str]]:
        """What failed on each of `hosts`, one description per failed slot in rank order."""
        wanted: dict[str, list[str]] = {host: [] for host in hosts}
        for slot, report in sorted(self.failures(), key=lambda item: item[1].rank):
            if slot[0] in wanted:
                wanted[slot[0]].append(report.describe(slot))
        return wanted

    def slots_on(self, host: str) -> list[Slot]:
        """The slots of `host` in the round, in rank order (none for a host it does not have)."""
        return [(host, local_rank) for local_rank in self._local_ranks.get(host, ())]

    def started_pids(self) -> list[list[Any]]:
        """[[host, local_rank, pid]] of the slots whose worker has its rank (to give a restarted rendezvous)."""
        return [
            [slot[0], slot[1], r.pid] for slot, r in self._reports.items() if r.pid is not None and r.state != PENDING
        ]

    def status_rows(self) -> list[dict[str, Any]]:
        """Every slot as the registry's `status` reply lists it, in rank order."""
        return [
            {
                "host": slot[0],
                "local_rank": slot[1],
                "rank": r.rank,
                "state": r.state,
                "pid": r.pid,
                "exit_code": r.exit_code,
                "reason": r.reason,
            }
            for slot, r in sorted(self._reports.items(), key=lambda item: item[1].rank)
        ]

    def is_current_worker(self, slot: Slot, pid: int) -> bool:
        """Is the process `pid` that exited the current round's worker of `slot`? A slot that has reported its end
        has none; one with a pid has that one; otherwise any process but a worker of an earlier round (a leftover
        that did not re-join) would have joined this round."""
        report = self._reports.get(slot)
        if report is None or report.state in (SUCCESS, FAILURE):
            return False
        if report.pid is not None:
            return report.pid == pid
        return pid not in self.retired_pids

    # -- changes -------------------------------------------------------------------------------
    def begin_round(self, ranks: Iterable[tuple[Slot, int]]) -> None:
        """The slots of a new round with their ranks, all PENDING. A slot whose worker re-joined (READY) keeps its
        pid; every other pid of the old round is retired (the newest `RETIRED_PIDS_KEPT` are kept)."""
        survivors = {slot: self._reports[slot].pid for slot in self._by_state[READY]}
        self.retired_pids.update(
            dict.fromkeys(r.pid for r in self._reports.values() if r.pid is not None and r.state != READY)
        )
        for pid in list(self.retired_pids)[: max(0, len(self.retired_pids) - RETIRED_PIDS_KEPT)]:
            del self.retired_pids[pid]
        self._fill({slot: SlotReport(rank, PENDING, survivors.get(slot)) for slot, rank in ranks})

    def _fill(self, reports: Mapping[Slot, SlotReport]) -> None:
        """The table holds `reports` (in rank order) and nothing else; every host's row is unsaved, and the rows of
        hosts it no longer has are to be dropped."""
        self._reports = dict(reports)
        for slots in self._by_state.values():
            slots.clear()
        for slot, report in self._reports.items():
            if report.state != FAILURE:
                self._by_state[report.state][slot] = None
        failed = sorted((r.failed_order, slot) for slot, r in self._reports.items() if r.state == FAILURE)
        self._by_state[FAILURE].update((slot, None) for _, slot in failed)
        self._local_ranks = {}
        for host, local_rank in self._reports:
            self._local_ranks.setdefault(host, []).append(local_rank)
        self._unsaved = dict.fromkeys(self._local_ranks)
        self._dropped = self._saved_hosts - self._local_ranks.keys()

    def record_started(self, slot: Slot, pid: int) -> None:
        """The released round gave the worker of `slot` its rank: a PENDING slot becomes RUNNING with `pid`."""
        report = self._reports.get(slot)
        if report is not None and report.state == PENDING:
            self._put(slot, report, SlotReport(report.rank, RUNNING, pid))

    def record_rejoined(self, slot: Slot, pid: int) -> bool:
        """The worker of `slot` asked to join the next round: a slot still PENDING or RUNNING becomes READY with
        `pid`. True when recorded."""
        report = self._reports.get(slot)
        if report is None or report.state not in SILENT:
            return False
        self._put(slot, report, SlotReport(report.rank, READY, pid))
        return True

    def record_success(self, slot: Slot, pid: int, exit_code: int | None, reason: str) -> None:
        report = self._reports[slot]
        self._put(slot, report, report._replace(state=SUCCESS, pid=pid, exit_code=exit_code, reason=reason))

    def record_failure(
        self, slot: Slot, reason: str, *, pid: int | None = None, exit_code: int | None = None, host_stays: bool = False
    ) -> bool:
        """`slot` failed (its pid kept when `pid` is None): it gets the next `failed_order`. True when it is the
        round's first failure."""
        report = self._reports[slot]
        failed_order = self.count(FAILURE) + 1
        pid = report.pid if pid is None else pid
        self._put(slot, report, SlotReport(report.rank, FAILURE, pid, exit_code, reason, failed_order, host_stays))
        return failed_order == 1

    def _put(self, slot: Slot, old: SlotReport, report: SlotReport) -> None:
        """`slot`'s report `old` becomes `report`."""
        del self._by_state[old.state][slot]
        self._reports[slot] = report
        self._by_state[report.state][slot] = None
        self._unsaved[slot[0]] = None

    # -- saving: one row per host ------------------------------------------------------------------
    def unsaved_rows(self) -> dict[str, str | None]:
        """host: its row as JSON, for the hosts whose reports changed since `saved` was last called; None for a host
        of an earlier round whose saved row must go. A row lists the host's slots as `ROW_FIELDS`. Empty when
        nothing changed. The retired pids are saved with the job."""
        rows: dict[str, str | None] = dict.fromkeys(self._dropped)
        for host in self._unsaved:
            row = [(local_rank, *self._reports[(host, local_rank)]) for local_rank in self._local_ranks[host]]
            rows[host] = json.dumps(row, separators=(",", ":"))
        return rows

    def saved(self, rows: Mapping[str, str | None]) -> None:
        """`rows`, as `unsaved_rows` gave them, are saved: those hosts are no longer unsaved."""
        for host, row in rows.items():
            self._unsaved.pop(host, None)
            self._dropped.discard(host)
            if row is None:
                self._saved_hosts.discard(host)
            else:
                self._saved_hosts.add(host)

    def replaces(self, previous: ReportTable) -> None:
        """This table is saved in the place of `previous` (a new job's): the rows `previous` saved that this one
        lacks are to be dropped with its next save."""
        self._saved_hosts = set(previous._saved_hosts)
        self._dropped = self._saved_hosts - self._local_ranks.keys()

    @classmethod
    def from_saved(cls, rows: Mapping[str, list[list[Any]]], retired_pids: Iterable[int]) -> ReportTable:
        """The table whose rows (host: its row as `unsaved_rows` wrote it, parsed) were saved."""
        reports = {(host, row[0]): SlotReport(*row[1:]) for host, host_rows in rows.items() for row in host_rows}
        table = cls(dict(sorted(reports.items(), key=lambda item: item[1].rank)), retired_pids)
        table._saved_hosts, table._unsaved, table._dropped = set(rows), {}, set()
        return table
