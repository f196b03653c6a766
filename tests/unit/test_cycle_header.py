"""A negotiation cycle's header (libworker.negotiation.CycleHeader): the minimum over the ranks' encodings, as the
cycle's one MIN-allreduce takes it, decodes to what every rank needs to know."""

from __future__ import annotations

from libworker.negotiation import CycleHeader


def _agreed(*headers: CycleHeader) -> CycleHeader:
    return CycleHeader.decode([min(values) for values in zip(*(header.encode() for header in headers))])


def test_a_condition_holds_only_if_it_holds_on_every_rank() -> None:
    active = CycleHeader(all_cached=True, all_joined=False, none_joined=True)
    joined = CycleHeader(all_cached=True, all_joined=True, none_joined=False)
    uncached = CycleHeader(all_cached=False, all_joined=False, none_joined=True)
    assert _agreed(active, active) == active
    assert _agreed(active, joined) == CycleHeader(all_cached=True, all_joined=False, none_joined=False)
    assert _agreed(joined, joined).all_joined
    assert not _agreed(active, uncached).all_cached


def test_the_newest_joiner_is_the_highest_rank_that_joined_in_the_cycle() -> None:
    joined = CycleHeader(all_cached=True, all_joined=True, none_joined=False)
    assert _agreed(joined, joined).newest_joiner is None
    assert _agreed(CycleHeader(True, True, False, newest_joiner=0), joined).newest_joiner == 0
    assert (
        _agreed(CycleHeader(True, True, False, newest_joiner=1), CycleHeader(True, True, False, 3)).newest_joiner == 3
    )
