"""Which past rounds' process groups libworker keeps holding: those with a work still pending, at most
RETIRED_MAX of them (libworker.torch_compat.RetiredGroups)."""

from __future__ import annotations

from dataclasses import dataclass

from libworker.torch_compat import RETIRED_MAX, RetiredGroups, RetiredRound


@dataclass
class Work:
    """What RetiredGroups asks of a torch.distributed Work."""

    done: bool = False

    def is_completed(self) -> bool:
        return self.done


def test_a_round_is_held_until_every_one_of_its_pending_works_has_ended() -> None:
    first, second = Work(), Work()
    retired = RetiredGroups()
    retired.retire(RetiredRound(groups=("group of round 1",), works=(first, second)))
    first.done = True
    retired.drop_ended()
    assert [r.groups for r in retired.rounds] == [("group of round 1",)]
    second.done = True
    retired.drop_ended()
    assert retired.rounds == []


def test_rounds_are_dropped_each_when_its_own_works_end() -> None:
    works = [Work() for _ in range(3)]
    retired = RetiredGroups()
    for number, work in enumerate(works, 1):
        retired.retire(RetiredRound(groups=(f"group of round {number}",), works=(work,)))
    works[1].done = True
    retired.drop_ended()
    assert [r.groups for r in retired.rounds] == [("group of round 1",), ("group of round 3",)]


def test_no_more_than_retired_max_rounds_are_held() -> None:
    retired = RetiredGroups()
    for number in range(1, RETIRED_MAX + 3):
        retired.retire(RetiredRound(groups=(f"group of round {number}",), works=(Work(),)))
    assert [r.groups[0] for r in retired.rounds] == [f"group of round {n}" for n in range(3, RETIRED_MAX + 3)]
