"""When the agent (or a worker) warns that its peer cannot be reached, how often, and when it says it can again."""

from __future__ import annotations

from elastic_control_plane.bus.reachability import Reachability


def test_first_warning_after_warn_after_counted_from_the_start() -> None:
    r = Reachability(warn_after=3.0, now=100.0)
    assert not r.missed(101.0)
    assert not r.missed(102.9)
    assert r.missed(103.0)
    assert r.silent_for(103.0) == 3.0


def test_then_at_most_one_warning_a_minute_however_often_it_retries() -> None:
    r = Reachability(warn_after=3.0, now=0.0)
    warnings = [t / 10 for t in range(0, 1500) if r.missed(t / 10)]
    assert warnings == [3.0, 63.0, 123.0]


def test_contacts_in_time_never_warn() -> None:
    r = Reachability(warn_after=3.0, now=0.0)
    for t in range(100):
        assert r.reached(float(t)) is None
        assert not r.missed(t + 0.5)


def test_recovery_after_a_warning_reports_the_silence_once() -> None:
    r = Reachability(warn_after=3.0, now=0.0)
    assert r.missed(4.0)
    assert r.reached(10.5) == 10.5
    assert r.reached(11.0) is None
    assert not r.missed(12.0)
    assert r.missed(14.0)


def test_a_silence_without_warning_is_no_recovery() -> None:
    r = Reachability(warn_after=3.0, now=0.0)
    assert not r.missed(2.0)
    assert r.reached(2.5) is None


def test_repeat_every_is_configurable() -> None:
    r = Reachability(warn_after=1.0, now=0.0, repeat_every=5.0)
    assert [t for t in range(20) if r.missed(float(t))] == [1, 6, 11, 16]
