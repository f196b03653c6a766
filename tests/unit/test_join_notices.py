"""Join notices as a waiting rank reads them (libworker.joining): it answers the joiners whose next operation
it waits in, keeps the notices of joiners it has not reached yet, drops those it has passed, and every rank can
tell when all joined after the same operation."""

from __future__ import annotations

from libworker.joining import CYCLE, STEP, Notice, Unanswered, all_joined_after, parse_notices


def test_notices_are_read_back_in_the_order_they_were_appended() -> None:
    assert parse_notices("1:41;0:7;") == [Notice(1, 41), Notice(0, 7)]
    assert parse_notices("") == []


def test_a_rank_waiting_in_the_joiners_next_operation_answers_what_it_is() -> None:
    waiting = Unanswered()
    assert waiting.answers([Notice(rank=1, operations=41)], {42: STEP + "optimizer.0"}) == {42: "step:optimizer.0"}
    assert waiting.waiting == []


def test_a_notice_for_an_operation_not_reached_yet_is_kept_and_answered_later() -> None:
    behind = Unanswered()
    notices = [Notice(rank=2, operations=10)]
    assert behind.answers(notices, {10: CYCLE}) == {}
    assert behind.waiting == [Notice(2, 10)]
    assert behind.answers(notices, {11: CYCLE}) == {11: CYCLE}
    assert behind.waiting == []


def test_a_notice_this_rank_has_passed_is_dropped_unanswered() -> None:
    ahead = Unanswered()
    assert ahead.answers([Notice(rank=0, operations=3)], {9: CYCLE}) == {}
    assert ahead.waiting == []


def test_a_notice_read_twice_is_one_notice_and_a_second_join_gets_its_own_answer() -> None:
    reader = Unanswered()
    first = [Notice(0, 3)]
    assert reader.answers(first, {}) == {}
    assert reader.answers(first, {}) == {}
    assert reader.waiting == [Notice(0, 3)]
    assert reader.answers(first, {4: CYCLE}) == {4: CYCLE}
    assert reader.answers(first + [Notice(0, 9)], {10: STEP + "opt"}) == {10: "step:opt"}


def test_every_rank_joined_after_the_same_operation_is_seen_by_each() -> None:
    two_of_three = [Notice(0, 5), Notice(2, 5)]
    assert not all_joined_after(two_of_three, 5, size=3)
    assert all_joined_after(two_of_three + [Notice(1, 5)], 5, size=3)
    assert not all_joined_after(two_of_three + [Notice(1, 5)], 4, size=3)
    assert not all_joined_after(two_of_three + [Notice(1, 6)], 5, size=3)
