"""What the registry's events mean to the goodput ledger (services/registry/goodput.py): a failure's cause from its
reason, when it began, and why a round re-joined with no fault (a drain, a preemption, a scale-up, a crashed slot
that went down or came back), read from discovery's brief host list; and `elasticctl report`'s table."""

from __future__ import annotations

from elastic_control_plane.elasticctl.report import render
from elastic_control_plane.services.registry.goodput import failure_cause, fault_instant, headline, planned_change
from elastic_control_plane.services.registry.ledger import CRASH, HANG, LOST_HOST, Ledger

ROUND = [["host-1", [0, 1]], ["host-2", [0, 1]]]


def hosts(available: list[list], lost: tuple[str, ...] = (), draining: tuple[str, ...] = ()) -> dict:
    return {"available": available, "lost": list(lost), "marked": [{"host": h, "draining": True} for h in draining]}


def test_a_failure_s_cause_and_when_it_began():
    assert failure_cause("exited with code 1; restarting in place") == CRASH
    assert failure_cause("its agent restarted (the workers died with the old one)") == CRASH
    assert failure_cause("hung: the others waited 40.2s for rank 1") == HANG
    assert failure_cause("host lost (missed heartbeats)") == LOST_HOST
    assert fault_instant(CRASH, 100.0, 3.0, 0.0) == 100.0 and fault_instant(CRASH, 100.0, 3.0, None) == 100.0
    assert fault_instant(CRASH, 100.0, 3.0, 2.5) == 97.5, "the others waited for it since"
    assert fault_instant(LOST_HOST, 100.0, 3.0, 3.5) == 96.5, "its workers died first: the others waited since"
    assert fault_instant(LOST_HOST, 100.0, 3.0, 0.0) == 100.0, "its workers trained on: no rank waited for it"
    assert fault_instant(LOST_HOST, 100.0, 3.0, None) == 97.0, "no waits known: its last heartbeat"


def test_why_a_round_re_joined_with_no_fault():
    ledger = Ledger(0.0, 4)
    assert planned_change(ledger, ROUND, hosts(ROUND, draining=("host-2",))) == ("drain", "host-2", True)
    assert planned_change(ledger, ROUND, hosts(ROUND[:1])) == ("preemption", "host-2", True)
    assert planned_change(ledger, ROUND, hosts(ROUND[:1], lost=("host-2",))) is None, "a lost host fails its slots"
    assert planned_change(ledger, ROUND, hosts([ROUND[0], ["host-2", [0]]])) == ("crash", "host-2", False)
    assert planned_change(ledger, ROUND, hosts([*ROUND, ["host-3", [0]]])) == ("scale_up", "host-3", True)
    assert planned_change(ledger, ROUND, hosts(ROUND)) is None


def test_a_crashed_slot_coming_back_is_its_crash_s_cost():
    ledger = Ledger(0.0, 4)
    ledger.released(1.0, 1, 4)
    ledger.fault(5.0, 5.0, CRASH, "host-2", "exited with code 1")
    ledger.released(6.0, 2, 3)
    back = hosts(ROUND)
    assert planned_change(ledger, [ROUND[0], ["host-2", [0]]], back) == ("crash", "host-2", True)
    assert planned_change(ledger, [ROUND[0], ["host-2", [0]]], hosts([*ROUND, ["host-3", [0]]]))[0] == "crash"


def test_the_report_table():
    ledger = Ledger(0.0, 4)
    ledger.released(10.0, 1, 3)
    ledger.fault(50.0, 50.0, CRASH, "host-2", "exited with code 1")
    ledger.released(52.0, 2, 4)
    shown = ledger.view(100.0, lambda local: 1_700_000_000.0 + local)
    text = render({"job": 3, "state": "running", "goodput": shown})
    lines = text.splitlines()
    assert lines[0] == f"job 3 (running): {headline(shown)}"
    assert "  training_below_size        40.0s  40.0%  (1 slot(s) short of 4 on average, at most 1)" in lines
    assert "(no commits reported: lost work is not counted; see docs/operations.md)" in text
    assert any(line.split()[:2] == ["host-2", "2.0s"] for line in lines)
    crash = next(line.split() for line in lines if line.split()[2:3] == ["crash"])  # AT is a date and a time
    assert crash[3:9] == ["host-2", "2.0", "0.0", "0.0", "0.0", "0.0"], "detected at its release: no decision told"
