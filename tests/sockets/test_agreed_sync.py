"""The sync decision after a reset, on real gloo ranks: the source is the lowest rank holding the newest commit, and
ranks that all hold the same commit (survivors, or workers that restored it from their host) get no broadcast."""

from __future__ import annotations

from typing import Any

from testing.ranks import run_ranks


def _record_syncs(state: Any) -> list[int]:
    """Make `state.sync` also note each root it syncs from, in the list returned."""
    synced_from: list[int] = []
    real_sync = state.sync

    def recording_sync(root_rank: int = 0) -> None:
        synced_from.append(root_rank)
        real_sync(root_rank)

    state.sync = recording_sync
    return synced_from


def _decide(held_by_rank: list[int | str]) -> tuple[int | None, int]:
    """Run `_agreed_sync` with this rank holding commit `held_by_rank[rank]` (-1: no state; "5+": commit 5 and live
    state trained past it); return (the root the sync came from, or None without a sync, and the commit this rank
    holds after)."""
    import torch.distributed as dist

    import libworker as elastic
    from libworker.elastic.runner import _agreed_sync
    from libworker.world import world

    held = held_by_rank[dist.get_rank()]
    state = elastic.ObjectState(marker=dist.get_rank())
    state._live_ahead = isinstance(held, str)
    state._commits = max(int(str(held).rstrip("+")), 0)
    world.holds_state = state._commits > 0 or held == 0
    synced_from = _record_syncs(state)
    _agreed_sync(state)
    return (synced_from[0] if synced_from else None), state._commits


CASES = [
    ([-1, -1, -1], 0, 0),  # the job's start: everyone from rank 0
    ([5, 5, 5], None, 5),  # every rank holds the newest commit: no broadcast
    ([5, 3, 5], 0, 5),  # one rank behind: the lowest rank holding the newest commit sends it
    ([2, 4, 4], 1, 4),
    ([-1, 7, 7], 1, 7),  # a fresh worker with nothing restored
    ([7, "7+", "7+"], 1, 7),  # survivors interrupted between commits hold newer state than a worker restored at 7
    (["7+", "7+"], None, 7),  # ... and among themselves they agree
]


def _decide_all(cases: list[list[int | str]]) -> list[tuple[int | None, int]]:
    return [_decide(held) for held in cases]


def test_the_newest_commit_wins_and_equal_commits_skip_the_broadcast() -> None:
    for size in (2, 3):
        cases = [case for case in CASES if len(case[0]) == size]
        per_rank = run_ranks(size, _decide_all, [held for held, _, _ in cases])
        for index, (held, root, after) in enumerate(cases):
            outcomes = {results[index] for results in per_rank}
            assert outcomes == {(root, after)}, f"commits {held}: {outcomes}"


def _sync_users_commits() -> tuple[int, bool, int, int]:
    """Rank 0 holds library commit 3 and the user's `commits=0`; every other rank holds commit 1, a larger user's
    `commits` and the user's `live_ahead=True`. Return (commits, live_ahead, the library's counter, the root the sync
    came from) after the agreed sync."""
    import torch
    import torch.distributed as dist

    import libworker as elastic
    from libworker.elastic.runner import _agreed_sync
    from libworker.world import world

    rank = dist.get_rank()
    model = torch.nn.Linear(2, 1)
    state = elastic.TorchState(
        model, torch.optim.SGD(model.parameters(), lr=0.1), commits=100 * rank, live_ahead=rank > 0
    )
    state._commits = 3 if rank == 0 else 1
    world.holds_state = True
    synced_from = _record_syncs(state)
    _agreed_sync(state)
    return state.commits, state.live_ahead, state._commits, synced_from[0]


def test_a_users_commits_travels_with_the_sync_and_the_decision_reads_only_the_librarys_counter() -> None:
    assert run_ranks(3, _sync_users_commits) == [(0, False, 3, 0)] * 3
