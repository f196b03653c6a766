"""Join notices on a real TCPStore: a rank waiting in an operation answers the joiners whose next operation it is,
keeps the notices of joiners it has not reached yet, and every rank can tell when all joined after the same one."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from libworker import join_notices
from libworker.join_notices import CYCLE, STEP, Notices


@pytest.fixture
def store() -> Iterator[dist.Store]:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5), wait_for_workers=False)
    yield dist.PrefixStore("round-7/", server)


def test_a_rank_waiting_in_the_joiners_next_operation_answers_what_it_is(store: dist.Store) -> None:
    join_notices.announce(store, rank=1, operations=41)
    assert join_notices.answer_to(store, 42) is None
    waiting = Notices()
    waiting.answer(store, {42: STEP + "optimizer.0"})
    assert join_notices.answer_to(store, 42) == "step:optimizer.0"
    assert waiting.waiting == []


def test_a_notice_for_an_operation_not_reached_yet_is_kept_and_answered_later(store: dist.Store) -> None:
    join_notices.announce(store, rank=2, operations=10)
    behind = Notices()
    behind.answer(store, {10: CYCLE})
    assert join_notices.answer_to(store, 11) is None
    assert behind.waiting == [(2, 10)]
    behind.answer(store, {11: CYCLE})
    assert join_notices.answer_to(store, 11) == CYCLE
    assert behind.waiting == []


def test_a_notice_read_twice_is_one_notice_and_a_second_join_gets_its_own_answer(store: dist.Store) -> None:
    notices = Notices()
    join_notices.announce(store, rank=0, operations=3)
    notices.read_new(store)
    notices.read_new(store)
    assert notices.waiting == [(0, 3)]
    notices.answer(store, {4: CYCLE})
    join_notices.announce(store, rank=0, operations=9)
    notices.answer(store, {10: STEP + "opt"})
    assert (join_notices.answer_to(store, 4), join_notices.answer_to(store, 10)) == (CYCLE, "step:opt")


def test_every_rank_joined_after_the_same_operation_is_seen_by_each(store: dist.Store) -> None:
    join_notices.announce(store, rank=0, operations=5)
    join_notices.announce(store, rank=2, operations=5)
    assert not Notices().all_joined_after(store, 5, size=3)
    join_notices.announce(store, rank=1, operations=5)
    assert Notices().all_joined_after(store, 5, size=3)
    assert not Notices().all_joined_after(store, 4, size=3)
