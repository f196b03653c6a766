"""The agent's slot book (agent/slots.py), without processes: crash, back-off, give-up and return, standbys, warm-up,
drain."""

from __future__ import annotations

from elastic_control_plane.agent.restarts import RestartPolicy
from elastic_control_plane.agent.slots import Remedy, SlotBook
from elastic_control_plane.agent.workers import STANDBY


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def running_book(max_restarts: int = 3, window: float = 60.0) -> tuple[SlotBook, Clock]:
    clock = Clock()
    book = SlotBook(clock)
    book.start_job(RestartPolicy(max_restarts, window), new_job=True)
    return book, clock


def test_a_crash_restarts_the_slot_at_once_and_the_next_ones_back_off():
    book, clock = running_book()
    first = book.crashed(1, standby_waiting=False)
    assert (first.remedy, first.delay) == (Remedy.RESTART, 0.0)
    assert book.due() == [1], "the first crash in the window restarts at once"
    assert book.due() == [], "a due restart is handed out once"
    second = book.crashed(1, standby_waiting=False)
    assert (second.remedy, second.delay) == (Remedy.RESTART, 1.0)
    assert book.due() == [] and book.restarting() == [1]
    clock.advance(1.0)
    assert book.due() == [1]


def test_only_a_worker_that_died_on_its_own_during_the_job_is_a_crash():
    book, _ = running_book()
    assert book.is_crash(1, stop_requested=False)
    assert not book.is_crash(0, stop_requested=False), "exit 0: it finished"
    assert not book.is_crash(-9, stop_requested=True), "the agent stopped it"
    book.begin_drain()
    assert not book.is_crash(1, stop_requested=False), "a draining host restarts nothing"
    idle = SlotBook(Clock())
    assert not idle.is_crash(1, stop_requested=False), "no job: nothing to restart for"


def test_a_waiting_standby_takes_a_crashed_slot_and_the_slot_is_never_due():
    book, _ = running_book()
    verdict = book.crashed(0, standby_waiting=True)
    assert verdict.remedy is Remedy.TAKE_STANDBY
    assert book.due() == [] and book.restarting() == []


def test_past_max_restarts_the_slot_is_given_up_then_returns_with_a_fresh_count():
    book, clock = running_book(max_restarts=2)
    verdicts = []
    for _ in range(3):
        verdicts.append(book.crashed(0, standby_waiting=False))
        clock.advance(0.5)
    assert [v.remedy for v in verdicts] == [Remedy.RESTART, Remedy.RESTART, Remedy.GIVE_UP]
    assert "crashed 3 times within 60s (--max-restarts 2)" in verdicts[-1].reason
    assert book.restarting() == [], "a given-up slot is not restarted by its agent"
    # Its host is blacklisted; when the cooldown ends (a few seconds here, well inside the window) the slot is in
    # a round again, and its next crash is restarted as a first one, as a Horovod host starts afresh.
    clock.advance(2.0)
    again = book.crashed(0, standby_waiting=False)
    assert (again.remedy, again.delay) == (Remedy.RESTART, 0.0)


def test_the_give_up_reason_names_the_policy():
    book, _ = running_book(max_restarts=0)
    verdict = book.crashed(3, standby_waiting=True)
    assert verdict.remedy is Remedy.GIVE_UP, "a give-up is not rescued by a standby"
    assert "--max-restarts 0" in verdict.reason


def test_crashes_outside_the_window_no_longer_count():
    book, clock = running_book(max_restarts=1, window=10.0)
    assert book.crashed(0, standby_waiting=False).remedy is Remedy.RESTART
    clock.advance(11.0)
    assert book.crashed(0, standby_waiting=False).remedy is Remedy.RESTART


def test_down_slots_change_with_a_new_version_each_time():
    book, _ = running_book()
    assert book.set_down(frozenset({1}))
    assert (book.down, book.down_version) == ({1}, 1)
    assert not book.set_down(frozenset({1})), "the same set: no report is due"
    assert book.set_down(book.down - {1})
    assert (book.down, book.down_version) == (frozenset(), 2)


def test_a_lost_host_registers_afresh_with_every_slot_up_and_nothing_due():
    book, _ = running_book()
    book.crashed(0, standby_waiting=False)
    book.set_down(frozenset({0}))
    book.host_lost()
    assert book.down == frozenset() and book.due() == []


def test_standbys_that_keep_dying_are_given_up_for_the_job_and_allowed_again_for_the_next():
    book, clock = running_book(max_restarts=1)
    assert book.may_keep_standbys()
    assert book.standby_died() == 0.0
    assert book.due() == [STANDBY]
    assert book.standby_died() is None
    assert not book.may_keep_standbys()
    book.start_job(RestartPolicy(1, 60.0), new_job=False)
    assert not book.may_keep_standbys(), "another round of the same job keeps them given up"
    book.start_job(RestartPolicy(1, 60.0), new_job=True)
    assert book.may_keep_standbys()


def test_no_standby_is_started_while_the_pool_waits_out_its_back_off():
    book, clock = running_book()
    book.standby_died()
    book.standby_died()
    assert not book.may_keep_standbys()
    clock.advance(1.0)
    assert book.due() == [STANDBY] and book.may_keep_standbys()


def test_warm_up_ends_with_the_last_slot_or_at_the_limit():
    book, clock = running_book()
    book.begin_warm_up(3, limit=120.0)
    assert not book.warmed(0) and not book.warmed(0) and not book.warmed(2)
    assert book.warmed(1), "the last slot waiting for a round"
    book.begin_warm_up(2, limit=120.0)
    book.warmed(0)
    assert book.warm_up_expired() == set()
    clock.advance(121.0)
    assert book.warm_up_expired() == {1}
    assert book.warm_up_expired() == set(), "given up on once"


def test_drain_clears_restarts_and_a_second_one_means_stop_now():
    book, clock = running_book()
    book.crashed(0, standby_waiting=False)
    assert book.begin_drain()
    assert book.due() == [] and not book.may_start_worker() and not book.may_keep_standbys()
    assert not book.begin_drain(), "a second SIGTERM"
    assert not book.drain_overdue(60.0)
    clock.advance(60.0)
    assert book.drain_overdue(60.0)


def test_a_finished_job_restarts_nothing():
    book, _ = running_book()
    book.crashed(0, standby_waiting=False)
    book.end_job()
    assert book.due() == [] and not book.may_start_worker()
