"""The sync decision after a reset, on real gloo ranks: the source is the lowest rank holding the newest commit, and
ranks that all hold the same commit (survivors, or workers that restored it from their host) get no broadcast."""

from __future__ import annotations

from tests.sockets.ranks import run_ranks


def _decide(held_by_rank: list[int]) -> tuple[int | None, int]:
    """Run `_agreed_sync` with this rank holding commit `held_by_rank[rank]` (-1: no state); return (the root the
    sync came from, or None without a sync, and the commit this rank holds after)."""
    import torch.distributed as dist

    import libworker as elastic
    from libworker.elastic.runner import _agreed_sync
    from libworker.world import world

    held = held_by_rank[dist.get_rank()]
    state = elastic.ObjectState(marker=dist.get_rank())
    state.commits = max(held, 0)
    world.holds_state = held >= 0
    synced_from: list[int] = []
    real_sync = state.sync

    def recording_sync(root_rank: int = 0) -> None:
        synced_from.append(root_rank)
        real_sync(root_rank)

    state.sync = recording_sync  # type: ignore[method-assign]
    _agreed_sync(state)
    return (synced_from[0] if synced_from else None), state.commits


CASES = [
    ([-1, -1, -1], 0, 0),  # the job's start: everyone from rank 0
    ([5, 5, 5], None, 5),  # every rank holds the newest commit: no broadcast
    ([5, 3, 5], 0, 5),  # one rank behind: the lowest rank holding the newest commit sends it
    ([2, 4, 4], 1, 4),
    ([-1, 7, 7], 1, 7),  # a fresh worker with nothing restored
]


def _decide_all(cases: list[list[int]]) -> list[tuple[int | None, int]]:
    return [_decide(held) for held in cases]


def test_the_newest_commit_wins_and_equal_commits_skip_the_broadcast() -> None:
    per_rank = run_ranks(3, _decide_all, [held for held, _, _ in CASES])
    for index, (held, root, after) in enumerate(CASES):
        outcomes = {results[index] for results in per_rank}
        assert outcomes == {(root, after)}, f"commits {held}: {outcomes}"
