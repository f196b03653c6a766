"""HostSet bookkeeping (discovery), effective(), compare() and parse_script_output(), with an injected clock and rng."""

from __future__ import annotations

import random

import pytest

from elastic_control_plane.services.discovery.hostset import (
    ACTIVE,
    BLACKLISTED,
    DRAINING,
    LOST,
    UNLISTED,
    HostsChange,
    HostSet,
    apply_diff,
    compare,
    effective,
    hosts_diff,
)
from elastic_control_plane.services.discovery.script import parse_script_output

LOST_AFTER = 3.0


def make(*hosts: tuple[str, int], now: float = 0.0, cooldown_range=(60.0, 600.0)) -> HostSet:
    hs = HostSet(rng=random.Random(0))
    hs.cooldown_range = cooldown_range
    for name, slots in hosts:
        hs.register(name, slots, f"{name}-inc1", now)
    return hs


def counts(hosts: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, int]]:
    return [(name, len(slots)) for name, slots in hosts]


def state_of(hs: HostSet, name: str) -> str:
    return hs.state(hs.hosts[name])


# -- register / heartbeat / expire ---------------------------------------------------------------


def test_registered_host_is_active_and_available():
    hs = make(("a", 2))
    assert state_of(hs, "a") == ACTIVE
    assert counts(hs.available()) == [("a", 2)]


def test_heartbeat_from_current_incarnation_is_ok():
    hs = make(("a", 2))
    assert hs.heartbeat("a", "a-inc1", 1.0) == "ok"


def test_heartbeat_from_unknown_host_is_unknown():
    hs = make(("a", 2))
    assert hs.heartbeat("nobody", "x", 1.0) == "unknown"


def test_heartbeat_from_other_incarnation_is_unknown():
    hs = make(("a", 2))
    assert hs.heartbeat("a", "a-inc0", 1.0) == "unknown"


def test_host_is_not_lost_at_exactly_lost_after():
    hs = make(("a", 2))
    assert hs.expire(LOST_AFTER, LOST_AFTER) == []
    assert state_of(hs, "a") == ACTIVE


def test_host_is_lost_after_silence_longer_than_lost_after():
    hs = make(("a", 2), ("b", 1))
    assert hs.heartbeat("b", "b-inc1", 2.0) == "ok"
    assert hs.expire(3.5, LOST_AFTER) == ["a"]
    assert state_of(hs, "a") == LOST
    assert state_of(hs, "b") == ACTIVE
    assert counts(hs.available()) == [("b", 1)]


def test_heartbeats_keep_a_host_alive():
    hs = make(("a", 2))
    for t in (1.0, 2.0, 3.0, 4.0, 5.0):
        assert hs.heartbeat("a", "a-inc1", t) == "ok"
        assert hs.expire(t + 0.5, LOST_AFTER) == []
    assert state_of(hs, "a") == ACTIVE


def test_expire_reports_a_lost_host_only_once():
    hs = make(("a", 2))
    assert hs.expire(10.0, LOST_AFTER) == ["a"]
    assert hs.expire(20.0, LOST_AFTER) == []


def test_a_host_its_source_says_is_gone_is_lost_at_once_and_no_other():
    hs = make(("a", 2), ("b", 2), ("c", 2))
    assert hs.declare_lost({"b", "unknown-host"}, 1.0) == ["b"]  # heartbeats fresh: only the host named
    assert [state_of(hs, n) for n in "abc"] == [ACTIVE, LOST, ACTIVE]
    assert hs.heartbeat("b", "b-inc1", 1.5) == "lost"  # its agent, if alive, stops its workers and registers again
    assert hs.declare_lost({"b"}, 2.0) == []  # once
    assert hs.heartbeat("a", "a-inc1", 3.0) == hs.heartbeat("c", "c-inc1", 3.0) == "ok"
    assert hs.expire(3.5, LOST_AFTER) == []  # not lost again for its silence
    assert counts(hs.available()) == [("a", 2), ("c", 2)]


def test_heartbeat_of_lost_host_returns_lost_and_does_not_revive_it():
    hs = make(("a", 2))
    hs.expire(10.0, LOST_AFTER)
    assert hs.heartbeat("a", "a-inc1", 11.0) == "lost"
    assert state_of(hs, "a") == LOST
    assert counts(hs.available()) == []


def test_heartbeat_of_lost_host_from_other_incarnation_is_unknown():
    hs = make(("a", 2))
    hs.expire(10.0, LOST_AFTER)
    assert hs.heartbeat("a", "a-inc2", 11.0) == "unknown"


def test_registering_again_after_lost_makes_host_active():
    hs = make(("a", 2))
    hs.expire(10.0, LOST_AFTER)
    hs.register("a", 4, "a-inc2", 11.0)
    assert state_of(hs, "a") == ACTIVE
    assert hs.heartbeat("a", "a-inc2", 12.0) == "ok"
    assert hs.heartbeat("a", "a-inc1", 12.0) == "unknown"
    assert counts(hs.available()) == [("a", 4)]


def test_unregister_needs_the_current_incarnation():
    hs = make(("a", 2))
    assert hs.unregister("a", "a-inc0") is False
    assert "a" in hs.hosts
    assert hs.unregister("a", "a-inc1") is True
    assert "a" not in hs.hosts
    assert hs.unregister("a", "a-inc1") is False


# -- assignment order ----------------------------------------------------------------------------


def test_assignment_order_is_registration_order_oldest_first():
    hs = make(("c", 1), ("a", 2), ("b", 3))
    assert counts(hs.available()) == [("c", 1), ("a", 2), ("b", 3)]


def test_a_new_host_goes_last():
    hs = make(("b", 1), ("c", 1))
    counts(hs.available())
    hs.register("a", 1, "a-inc1", 1.0)
    assert [n for n, _ in counts(hs.available())] == ["b", "c", "a"]


def test_surviving_hosts_keep_their_order_when_one_leaves():
    hs = make(("a", 1), ("b", 1), ("c", 1), ("d", 1))
    counts(hs.available())
    for name in ("a", "c", "d"):
        hs.heartbeat(name, f"{name}-inc1", 5.0)
    hs.expire(5.0, LOST_AFTER)  # b silent since 0
    assert [n for n, _ in counts(hs.available())] == ["a", "c", "d"]


def test_a_host_that_leaves_and_returns_goes_last():
    hs = make(("a", 1), ("b", 1), ("c", 1))
    counts(hs.available())
    hs.heartbeat("b", "b-inc1", 5.0)
    hs.heartbeat("c", "c-inc1", 5.0)
    hs.expire(5.0, LOST_AFTER)  # a lost
    assert [n for n, _ in counts(hs.available())] == ["b", "c"]
    hs.register("a", 1, "a-inc2", 6.0)
    assert [n for n, _ in counts(hs.available())] == ["b", "c", "a"]


def test_a_host_that_unregisters_and_returns_goes_last():
    hs = make(("a", 1), ("b", 1))
    counts(hs.available())
    hs.unregister("a", "a-inc1")
    counts(hs.available())
    hs.register("a", 1, "a-inc2", 1.0)
    assert [n for n, _ in counts(hs.available())] == ["b", "a"]


def test_a_slot_count_change_keeps_the_hosts_place():
    hs = make(("a", 1), ("b", 1))
    counts(hs.available())
    hs.register("a", 4, "a-inc2", 1.0)
    assert counts(hs.available()) == [("a", 4), ("b", 1)]


# -- draining ------------------------------------------------------------------------------------


def test_draining_host_is_not_available():
    hs = make(("a", 1), ("b", 2))
    counts(hs.available())
    hs.set_draining("a", True)
    assert state_of(hs, "a") == DRAINING
    assert counts(hs.available()) == [("b", 2)]


def test_undrained_host_comes_back_last():
    hs = make(("a", 1), ("b", 2))
    counts(hs.available())
    hs.set_draining("a", True)
    counts(hs.available())
    hs.set_draining("a", False)
    assert state_of(hs, "a") == ACTIVE
    assert counts(hs.available()) == [("b", 2), ("a", 1)]


def test_draining_host_still_heartbeats_ok():
    hs = make(("a", 1))
    hs.set_draining("a", True)
    assert hs.heartbeat("a", "a-inc1", 1.0) == "ok"


# -- blacklist and cooldown ----------------------------------------------------------------------


def test_blacklisted_host_is_not_available_until_its_cooldown_ends():
    hs = make(("a", 1), ("b", 1))
    counts(hs.available())
    until = hs.blacklist("a", 100.0, "failure in round 1")
    assert until is not None
    assert 160.0 <= until <= 175.0  # 60 s * (1 + up to 25% jitter)
    assert state_of(hs, "a") == BLACKLISTED
    assert counts(hs.available()) == [("b", 1)]
    assert hs.lift_cooldowns(until - 0.001) == []
    assert state_of(hs, "a") == BLACKLISTED


def test_lift_cooldowns_brings_the_host_back_last():
    hs = make(("a", 1), ("b", 1))
    counts(hs.available())
    until = hs.blacklist("a", 100.0, "failure")
    counts(hs.available())
    assert hs.lift_cooldowns(until) == ["a"]
    assert state_of(hs, "a") == ACTIVE
    assert counts(hs.available()) == [("b", 1), ("a", 1)]
    assert hs.lift_cooldowns(until + 1000.0) == []


def test_blacklist_records_reason_and_count():
    hs = make(("a", 1))
    hs.blacklist("a", 0.0, "first")
    hs.blacklist("a", 1.0, "second")
    record = hs.hosts["a"]
    assert record.blacklist_count == 2
    assert record.blacklist_reason == "second"


def test_cooldown_grows_exponentially_and_is_capped():
    hs = make(("a", 1))
    periods = []
    for n in range(7):
        now = 10_000.0 * n  # past the previous cooldown; round numbers keep `until - now` exact
        until = hs.blacklist("a", now, "failure")
        periods.append(until - now)
        assert hs.lift_cooldowns(until) == ["a"]
    # count n: 60 * 2^(n-1), jittered up by at most 25%, never above 600
    bounds = [(60, 75), (120, 150), (240, 300), (480, 600), (600, 600), (600, 600), (600, 600)]
    for period, (low, high) in zip(periods, bounds, strict=True):
        assert low <= period <= high
    assert periods[0] < periods[1] < periods[2] < periods[3]
    assert max(periods) == 600.0


def test_cooldown_is_deterministic_with_an_injected_rng():
    a, b = make(("a", 1)), make(("a", 1))
    assert [a.blacklist("a", t, "x") for t in (0.0, 1.0, 2.0)] == [b.blacklist("a", t, "x") for t in (0.0, 1.0, 2.0)]


def test_cooldown_range_is_respected():
    hs = make(("a", 1), cooldown_range=(1.0, 3.0))
    periods = []
    for n in range(5):
        periods.append(hs.blacklist("a", 10.0 * n, "x") - 10.0 * n)
    assert 1.0 <= periods[0] <= 1.25
    assert 2.0 <= periods[1] <= 2.5
    assert periods[2:] == [3.0, 3.0, 3.0]


def test_cooldown_range_none_blacklists_forever():
    hs = make(("a", 1), ("b", 1), cooldown_range=None)
    assert hs.blacklist("a", 0.0, "failure") is None
    assert state_of(hs, "a") == BLACKLISTED
    assert hs.lift_cooldowns(1e12) == []
    assert counts(hs.available()) == [("b", 1)]
    assert hs.describe(5.0)[-1]["cooldown_left"] is None
    assert hs.describe(5.0)[-1]["blacklisted"] is True


def test_blacklisting_an_unknown_host_does_nothing():
    hs = make(("a", 1))
    assert hs.blacklist("nobody", 0.0, "x") is None
    assert counts(hs.available()) == [("a", 1)]


def test_blacklist_survives_reregistration():
    hs = make(("a", 1), ("b", 1))
    hs.blacklist("a", 0.0, "failure")
    hs.register("a", 1, "a-inc2", 1.0)
    assert state_of(hs, "a") == BLACKLISTED
    assert counts(hs.available()) == [("b", 1)]


def test_describe_reports_cooldown_left():
    hs = make(("a", 1))
    until = hs.blacklist("a", 100.0, "boom")
    row = hs.describe(110.0)[0]
    assert row["state"] == BLACKLISTED
    assert row["cooldown_left"] == round(until - 110.0, 3)
    assert row["blacklist_reason"] == "boom"
    assert row["blacklist_count"] == 1


# -- discovery script intersection ---------------------------------------------------------------


def test_script_slots_smaller_than_agent_slots_win():
    hs = make(("a", 4))
    hs.script_hosts = {"a": 2}
    assert counts(hs.available()) == [("a", 2)]


def test_agent_slots_smaller_than_script_slots_win():
    hs = make(("a", 2))
    hs.script_hosts = {"a": 8}
    assert counts(hs.available()) == [("a", 2)]


def test_script_host_without_slots_uses_agent_slots():
    hs = make(("a", 3))
    hs.script_hosts = {"a": None}
    assert counts(hs.available()) == [("a", 3)]


def test_hosts_not_listed_by_the_script_are_excluded():
    hs = make(("a", 2), ("b", 2), ("c", 2))
    hs.script_hosts = {"a": None, "c": 1}
    assert counts(hs.available()) == [("a", 2), ("c", 1)]
    assert state_of(hs, "b") == UNLISTED


def test_script_listed_host_without_agent_is_not_available():
    hs = make(("a", 2))
    hs.script_hosts = {"a": None, "ghost": 4}
    assert counts(hs.available()) == [("a", 2)]


def test_script_listing_zero_slots_excludes_the_host():
    hs = make(("a", 2), ("b", 2))
    hs.script_hosts = {"a": 0, "b": None}
    assert counts(hs.available()) == [("b", 2)]


def test_script_none_means_no_filter():
    hs = make(("a", 2), ("b", 1))
    hs.script_hosts = {"a": None}
    counts(hs.available())
    hs.script_hosts = None
    assert counts(hs.available()) == [("a", 2), ("b", 1)]


# -- effective -----------------------------------------------------------------------------------

UNEVEN = [("a", 2), ("b", 1), ("c", 3)]


@pytest.mark.parametrize(
    ("max_np", "expected"),
    [
        (None, [("a", 2), ("b", 1), ("c", 3)]),
        (6, [("a", 2), ("b", 1), ("c", 3)]),
        (100, [("a", 2), ("b", 1), ("c", 3)]),
        (5, [("a", 2), ("b", 1), ("c", 2)]),
        (4, [("a", 2), ("b", 1), ("c", 1)]),
        (3, [("a", 2), ("b", 1)]),
        (2, [("a", 2)]),
        (1, [("a", 1)]),
        (0, []),
    ],
)
def test_effective_fills_hosts_in_order_up_to_max_np(max_np, expected):
    assert counts(effective(UNEVEN, max_np)) == expected


def test_effective_of_nothing_is_nothing():
    assert effective([], None) == []
    assert effective([], 4) == []


def test_effective_returns_slot_ids_from_the_first():
    assert effective([("a", 3), ("b", (0, 2))], 4) == [("a", (0, 1, 2)), ("b", (0,))]


def test_effective_skips_a_zero_slot_host_and_keeps_filling():
    assert counts(effective([("a", 2), ("z", 0), ("b", 2)], None)) == [("a", 2), ("b", 2)]


# -- compare (Horovod's check_update) ------------------------------------------------------------


def test_compare_no_change_is_none():
    assert compare([("a", 2), ("b", 1)], [("a", 2), ("b", 1)]) is None
    assert compare([], []) is None


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ([("a", 2)], [("a", 2), ("b", 1)], HostsChange(added=True, removed=False)),
        ([], [("a", 1)], HostsChange(added=True, removed=False)),
        ([("a", 2), ("b", 1)], [("a", 2)], HostsChange(added=False, removed=True)),
        ([("a", 2)], [], HostsChange(added=False, removed=True)),
        ([("a", 2), ("b", 1)], [("b", 1), ("c", 2)], HostsChange(added=True, removed=True)),
        ([("a", 2)], [("a", 4)], HostsChange(added=True, removed=False)),
        ([("a", 4)], [("a", 2)], HostsChange(added=False, removed=True)),
        ([("a", 4), ("b", 1)], [("a", 2), ("b", 3)], HostsChange(added=True, removed=True)),
        ([("a", 2), ("b", 2)], [("a", 1), ("c", 2)], HostsChange(added=True, removed=True)),
    ],
    ids=[
        "host_added",
        "first_host_added",
        "host_removed",
        "last_host_removed",
        "added_and_removed",
        "more_slots_is_added",
        "fewer_slots_is_removed",
        "more_and_fewer_slots",
        "fewer_slots_and_new_host",
    ],
)
def test_compare_like_horovod_check_update(before, after, expected):
    assert compare(before, after) == expected


def test_compare_reorder_is_a_change():
    assert compare([("a", 1), ("b", 1)], [("b", 1), ("a", 1)]) is not None


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ([("a", 2), ("b", 2)], [("a", 2), ("b", 2), ("c", 2)]),  # host added past max_np
        ([("a", 2), ("b", 2), ("c", 2)], [("a", 2), ("b", 2)]),  # host removed past max_np
        ([("a", 2), ("b", 2), ("c", 2)], [("a", 2), ("b", 2), ("c", 8)]),  # slots change past max_np
        ([("a", 2), ("b", 3)], [("a", 2), ("b", 5)]),  # more slots on a host already cut by max_np
    ],
    ids=["added_beyond", "removed_beyond", "slots_beyond", "slots_on_cut_host"],
)
def test_change_only_beyond_max_np_is_no_difference_after_effective(before, after):
    assert compare(before, after) is not None  # raw lists differ
    assert compare(effective(before, 4), effective(after, 4)) is None


def test_change_that_reaches_into_max_np_is_a_difference_after_effective():
    # b shrinks from 3 to 1, so c now gets a slot under max_np 4
    before, after = [("a", 2), ("b", 3), ("c", 2)], [("a", 2), ("b", 1), ("c", 2)]
    assert compare(effective(before, 4), effective(after, 4)) == HostsChange(added=True, removed=True)


# -- parse_script_output -------------------------------------------------------------------------


def test_parse_hosts_with_and_without_slots():
    assert parse_script_output("a\nb:4\nc:1\n") == {"a": None, "b": 4, "c": 1}


def test_parse_ignores_comments_blank_lines_and_whitespace():
    text = "# hosts for the job\n\n  a:2  \n\t\nb # trailing comment\n   # indented comment\nc:3# tight comment\n"
    assert parse_script_output(text) == {"a": 2, "b": None, "c": 3}


def test_parse_empty_output_is_no_hosts():
    assert parse_script_output("") == {}
    assert parse_script_output("\n# nothing\n\n") == {}


def test_parse_keeps_line_order():
    assert list(parse_script_output("z\ny:1\nx\n")) == ["z", "y", "x"]


def test_parse_zero_slots_is_allowed():
    assert parse_script_output("a:0") == {"a": 0}


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("a\nb:x\n", 2),
        ("a:\n", 1),
        ("a\n# c\n\n:4\n", 4),
        ("a\nb:-1\n", 2),
        ("a\nb:1.5\n", 2),
        ("a:2:3\n", 1),
    ],
    ids=[
        "non_numeric_slots",
        "empty_slots",
        "empty_name_after_comment_and_blank",
        "negative_slots",
        "float_slots",
        "two_colons",
    ],
)
def test_parse_bad_line_raises_value_error_with_line_number(text, line):
    with pytest.raises(ValueError, match=rf"\bline {line}\b"):
        parse_script_output(text)


def test_parse_superscript_digit_slots_reports_the_line_number():
    with pytest.raises(ValueError, match=r"\bline 2\b"):
        parse_script_output("a\nb:²\n")


def test_forgive_silence_restarts_the_clock_of_live_hosts_only() -> None:
    hosts = HostSet()
    hosts.register("a", 2, "inc-a", now=0.0)
    hosts.register("b", 2, "inc-b", now=0.0)
    assert hosts.expire(now=5.0, lost_after=3.0) == ["a", "b"]
    hosts.register("a", 2, "inc-a2", now=5.0)
    hosts.forgive_silence(now=20.0)
    assert hosts.expire(now=21.0, lost_after=3.0) == []
    assert hosts.hosts["b"].lost_at == 5.0


def test_a_warming_host_is_listed_but_not_available_until_warm() -> None:
    hosts = HostSet()
    hosts.register("a", 2, "inc-a", now=0.0)
    hosts.register("b", 2, "inc-b", now=0.0, warm=False)
    assert counts(hosts.available()) == [("a", 2)]
    assert [(row["host"], row["state"]) for row in hosts.describe(0.0)] == [("a", "active"), ("b", "warming")]
    assert hosts.heartbeat("b", "inc-b", now=1.0, warm=True) == "ok"
    assert counts(hosts.available()) == [("a", 2), ("b", 2)]


# -- slots down while their worker restarts -------------------------------------------------------


def test_a_down_slot_is_left_out_and_comes_back_at_its_own_id():
    hs = make(("a", 3), ("b", 1))
    assert hs.set_down("a", "a-inc1", [1], 1) == "ok"
    assert hs.available() == [("a", (0, 2)), ("b", (0,))]
    assert hs.set_down("a", "a-inc1", [], 2) == "ok"
    assert hs.available() == [("a", (0, 1, 2)), ("b", (0,))]


def test_an_older_down_report_arriving_late_is_ignored():
    hs = make(("a", 2))
    hs.set_down("a", "a-inc1", [], 3)
    hs.set_down("a", "a-inc1", [0], 2)
    assert hs.available() == [("a", (0, 1))]


def test_a_host_with_every_slot_down_is_not_available_and_returns_last():
    hs = make(("a", 1), ("b", 1))
    hs.available()
    hs.set_down("a", "a-inc1", [0], 1)
    assert hs.available() == [("b", (0,))]
    hs.set_down("a", "a-inc1", [], 2)
    assert hs.available() == [("b", (0,)), ("a", (0,))]


def test_down_report_of_another_incarnation_is_unknown_and_a_new_incarnation_starts_fresh():
    hs = make(("a", 2))
    assert hs.set_down("a", "old", [0], 9) == "unknown"
    hs.set_down("a", "a-inc1", [0], 9)
    hs.register("a", 2, "a-inc2", 1.0, down=[1], down_version=1)
    assert hs.available() == [("a", (0,))]


def test_compare_sees_a_slot_swap_with_the_same_count():
    assert compare([("a", (0, 2))], [("a", (0, 1))]) == HostsChange(added=True, removed=True)
    assert compare([("a", (0,))], [("a", (0, 1))]) == HostsChange(added=True, removed=False)


# -- a restarted discovery, given back what it held ----------------------------------------------
def test_restored_marks_wait_for_their_host_and_keep_newer_decisions() -> None:
    from elastic_control_plane.services.discovery.hostset import Mark

    hs = make(("a", 2), now=0.0)
    hs.blacklist("a", 0.0, "newer decision")
    hs.restore(
        {
            "a": Mark(draining=True, blacklisted=True, until=50.0, count=1, reason="old"),
            "b": Mark(blacklisted=True, until=30.0, count=2, reason="crash"),
        }
    )
    a = hs.hosts["a"]
    assert a.draining and a.blacklist_reason == "newer decision" and a.blacklisted_until != 50.0, (
        "a record's own blacklist wins"
    )
    assert "b" not in hs.hosts and "b" in hs.pending_marks
    hs.register("b", 2, "b-inc1", 1.0)
    b = hs.hosts["b"]
    assert (hs.state(b), b.blacklisted_until, b.blacklist_count, b.blacklist_reason) == (BLACKLISTED, 30.0, 2, "crash")
    assert not hs.pending_marks
    assert hs.lift_cooldowns(30.0) == ["b"]


def test_hosts_of_the_round_that_never_came_back_are_lost() -> None:
    hs = make(("a", 2), now=0.0)
    assert hs.record_missing([("a", (0, 1)), ("b", (0, 3))], 5.0) == ["b"]
    b = hs.hosts["b"]
    assert (hs.state(b), b.slots, b.lost_at) == (LOST, 4, 5.0)
    assert hs.state(hs.hosts["a"]) == ACTIVE
    hs.register("b", 4, "b-inc2", 6.0)
    assert hs.state(hs.hosts["b"]) == ACTIVE, "a host recorded lost registers again as usual"


def test_a_restore_puts_the_hosts_back_in_the_job_s_order_and_holds_their_places_until_they_are_back() -> None:
    hs = make(("c", 1), ("b", 1), now=0.0)
    hs.restore({}, ["a", "b", "c"])
    assert [name for name, _ in hs.available()] == ["b", "c"], "a is not back yet, and keeps its place"
    hs.register("a", 1, "a-inc1", 1.0)
    assert [name for name, _ in hs.available()] == ["a", "b", "c"]
    hs.record_missing([("a", (0,)), ("b", (0,)), ("c", (0,))], 2.0)
    hs.unregister("a", "a-inc1")
    hs.available()
    hs.register("a", 1, "a-inc2", 3.0)
    assert [name for name, _ in hs.available()] == ["b", "c", "a"], "once settled, a host that returns goes last again"


# -- scale: diffs, O(1) expiry ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("before", "after"),
    [
        ([], [("a", (0, 1))]),
        ([("a", (0, 1)), ("b", (0,))], [("a", (0, 1))]),
        ([("a", (0, 1)), ("b", (0,))], [("a", (0,)), ("b", (0,)), ("c", (0, 1, 2))]),
        ([("a", (0,)), ("b", (0,)), ("c", (0,))], [("a", (0,)), ("c", (0,))]),
        ([("a", (0,)), ("b", (0,))], [("b", (0,)), ("c", (1,))]),
    ],
)
def test_a_diff_applied_to_the_list_before_gives_the_list_after(before, after) -> None:
    diff = hosts_diff(before, after)
    assert diff is not None
    assert apply_diff(before, diff) == after


def test_a_diff_names_only_what_changed() -> None:
    before = [(f"h{i}", (0, 1)) for i in range(1000)]
    after = [*before[:10], *before[11:], ("h10", (0, 1))][:-1] + [("new", (0,))]
    diff = hosts_diff(before, after)
    assert diff is not None and diff.set == [("new", (0,))] and diff.remove == ["h10"]


def test_a_host_that_left_and_came_back_in_between_needs_the_whole_list() -> None:
    assert hosts_diff([("a", (0,)), ("b", (0,))], [("b", (0,)), ("a", (0,))]) is None


def test_expiry_looks_only_at_the_hosts_silent_longest() -> None:
    hs = HostSet()
    for i in range(10_000):
        hs.register(f"h{i}", 8, "i", now=0.0)
    for i in range(1, 10_000):
        hs.heartbeat(f"h{i}", "i", now=2.0)
    calls = 0

    class Counting(dict):
        def __getitem__(self, key):
            nonlocal calls
            calls += 1
            return super().__getitem__(key)

    hs.hosts = Counting(hs.hosts)
    assert hs.expire(now=3.5, lost_after=LOST_AFTER) == ["h0"]
    assert calls <= 2, f"expiry read {calls} host records to find one silent host"
    hs.heartbeat("h5", "i", now=4.0)
    assert hs.expire(now=5.5, lost_after=LOST_AFTER) == [f"h{i}" for i in range(1, 10_000) if i != 5]
    assert hs.expire(now=6.0, lost_after=LOST_AFTER) == []
    assert hs.expire(now=7.5, lost_after=LOST_AFTER) == ["h5"]
