"""ElasticSampler over simulated worlds: every rank has its own sampler; ranks step in lockstep; resets re-shard.

The sampler reads its rank and size from `libworker.world.world.slot`; the `ranks` fixture sets that dict
for each simulated rank (monkeypatch restores the original at the end).
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from libworker.elastic.sampler import ElasticSampler
from libworker.world import world

N = 103
DATASET = list(range(N))
BATCH = 5


class Ranks:
    """Switch the process-wide slot to a simulated rank."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(world, "slot", {})

    def use(self, rank: int, size: int) -> None:
        world.slot = {"rank": rank, "size": size}

    def new_world(self, size: int, state=None, reuse=(), dataset=DATASET, **kw) -> list[ElasticSampler]:
        """Samplers for ranks 0..size-1: reuse the given ones first (as survivors do), create the rest.

        A survivor is reset on the new world (TorchState.on_reset), then every rank loads the broadcast state.
        """
        samplers = []
        reuse = list(reuse)
        for rank in range(size):
            self.use(rank, size)
            if reuse:
                sampler = reuse.pop(0)
                sampler.reset()
            else:
                sampler = ElasticSampler(dataset, **kw)
            if state is not None:
                sampler.load_state_dict(state)
            samplers.append(sampler)
        return samplers

    def reset_only(self, survivors: list[ElasticSampler]) -> list[ElasticSampler]:
        """Hosts only removed (sync skipped): each survivor re-shards from its own state, no broadcast."""
        size = len(survivors)
        for rank, sampler in enumerate(survivors):
            self.use(rank, size)
            sampler.reset()
        return survivors

    def set_epoch(self, samplers: list[ElasticSampler], epoch: int) -> None:
        """Every rank calls set_epoch (which re-reads its slot)."""
        for rank, sampler in enumerate(samplers):
            self.use(rank, len(samplers))
            sampler.set_epoch(epoch)

    def step(self, samplers: list[ElasticSampler], batches: int | None = None, batch_size: int = BATCH) -> list[int]:
        """Iterate every rank's sampler and record `batches` batches in lockstep (None: to the end of the shard).

        Checks on the way that all ranks have the same length and that record_batch returns the real
        (non-padding) head of the batch the iterator produced. Returns every recorded index.
        """
        size = len(samplers)
        lengths = {len(s) for s in samplers}
        assert len(lengths) == 1, f"ranks of one world disagree on len(sampler): {lengths}"
        length = lengths.pop()
        if batches is None:
            batches = math.ceil(length / batch_size)
        streams = []
        for rank, sampler in enumerate(samplers):
            self.use(rank, size)
            stream = list(iter(sampler))
            assert len(stream) == length
            streams.append(stream)
        recorded = []
        for batch_idx in range(batches):
            for rank, sampler in enumerate(samplers):
                self.use(rank, size)
                got = sampler.record_batch(batch_idx, batch_size)
                batch = streams[rank][batch_idx * batch_size : (batch_idx + 1) * batch_size]
                assert got == batch[: len(got)]
                recorded.extend(got)
        return recorded


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> Ranks:
    return Ranks(monkeypatch)


def assert_each_once(recorded: list[int], n: int = N) -> None:
    counts = Counter(recorded)
    repeated = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    assert not repeated and not missing, f"repeated {repeated}, missing {missing}"
    assert len(recorded) == n


# -- a whole epoch across resets -----------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [True, False])
def test_epoch_over_4_then_2_then_3_ranks_returns_every_index_once(ranks, shuffle):
    world4 = ranks.new_world(4, shuffle=shuffle, seed=7)
    ranks.set_epoch(world4, 0)
    recorded = ranks.step(world4, batches=3)
    assert len(recorded) == 4 * 3 * BATCH

    state = world4[2].state_dict()
    world2 = ranks.new_world(2, state=state, reuse=world4[:2], shuffle=shuffle, seed=7)
    assert len(world2[0]) == math.ceil((N - 60) / 2)
    recorded += ranks.step(world2, batches=2)
    assert len(recorded) == 60 + 2 * 2 * BATCH

    state = world2[1].state_dict()
    world3 = ranks.new_world(3, state=state, reuse=world2, shuffle=shuffle, seed=7)
    assert len(world3[0]) == math.ceil((N - 80) / 3)
    recorded += ranks.step(world3)

    assert_each_once(recorded)
    assert all(len(s) == 0 for s in world3)
    assert world3[0].state_dict() == {"epoch": 0, "processed_indices": list(range(N))}


def test_epoch_with_fresh_samplers_on_every_reset_returns_every_index_once(ranks):
    world4 = ranks.new_world(4, seed=3)
    recorded = ranks.step(world4, batches=2)
    world2 = ranks.new_world(2, state=world4[0].state_dict(), seed=3)
    recorded += ranks.step(world2, batches=3)
    world3 = ranks.new_world(3, state=world2[0].state_dict(), seed=3)
    recorded += ranks.step(world3)
    assert_each_once(recorded)


def test_shrink_without_sync_each_survivor_agrees_and_every_index_is_returned_once(ranks):
    world4 = ranks.new_world(4, seed=1)
    recorded = ranks.step(world4, batches=3)
    survivors = ranks.reset_only([world4[1], world4[3]])  # ranks 0 and 2 left; old ranks 1 and 3 become 0 and 1
    assert survivors[0].state_dict() == survivors[1].state_dict()
    recorded += ranks.step(survivors, batches=2)
    world3 = ranks.new_world(3, state=survivors[0].state_dict(), reuse=survivors, seed=1)
    recorded += ranks.step(world3)
    assert_each_once(recorded)


def test_growing_world_returns_every_index_once(ranks):
    world1 = ranks.new_world(1)
    recorded = ranks.step(world1, batches=4)
    world5 = ranks.new_world(5, state=world1[0].state_dict(), reuse=world1)
    recorded += ranks.step(world5, batches=1)
    world2 = ranks.new_world(2, state=world5[4].state_dict(), reuse=world5[:2])
    recorded += ranks.step(world2)
    assert_each_once(recorded)


def test_reset_mid_batch_sequence_on_a_partial_last_batch(ranks):
    # batch size 7 leaves ragged ends on every world
    world4 = ranks.new_world(4)
    recorded = ranks.step(world4, batches=2, batch_size=7)
    world3 = ranks.new_world(3, state=world4[0].state_dict(), reuse=world4[:3])
    recorded += ranks.step(world3, batches=1, batch_size=7)
    world2 = ranks.new_world(2, state=world3[0].state_dict(), reuse=world3[:2])
    recorded += ranks.step(world2, batch_size=7)
    assert_each_once(recorded)


def test_restore_to_the_last_commit_serves_uncommitted_batches_again_and_loses_none(ranks):
    world4 = ranks.new_world(4)
    committed_part = ranks.step(world4, batches=2)
    committed = world4[0].state_dict()  # commit()
    lost_work = ranks.step(world4, batches=1)  # done, then a worker dies before the next commit
    world3 = ranks.new_world(3, state=committed, reuse=world4[:3])  # restore() + sync from rank 0
    after_restore = ranks.step(world3)
    assert set(lost_work) <= set(after_restore)
    assert_each_once(committed_part + after_restore)


# -- lengths -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 7, 8, 103, 104])
def test_all_ranks_of_a_world_have_the_same_length(ranks, size):
    samplers = ranks.new_world(size)
    assert {len(s) for s in samplers} == {math.ceil(N / size)}


@pytest.mark.parametrize("size", [1, 3, 4, 7, 103, 104, 150])
def test_shards_of_a_world_are_disjoint_and_cover_the_dataset(ranks, size):
    samplers = ranks.new_world(size)
    recorded = ranks.step(samplers)
    assert_each_once(recorded)


def test_padding_is_iterated_but_never_recorded(ranks):
    # 103 over 4: shards of 26, 26, 26, 25; rank 3 gets one padding index at the end
    samplers = ranks.new_world(4, shuffle=False)
    ranks.use(3, 4)
    stream = list(iter(samplers[3]))
    assert len(stream) == 26
    assert stream[:25] == list(range(3, N, 4))
    assert stream[25] % 4 != 3  # padding: an index that belongs to another rank
    assert samplers[3].record_batch(0, 26) == list(range(3, N, 4))
    ranks.use(0, 4)
    assert samplers[0].record_batch(0, 26) == list(range(0, N, 4))


def test_len_shrinks_as_batches_are_recorded(ranks):
    samplers = ranks.new_world(2)
    ranks.step(samplers, batches=3)
    assert [len(s) for s in samplers] == [52 - 15, 52 - 15]


def test_a_new_iteration_continues_after_the_recorded_batches(ranks):
    samplers = ranks.new_world(2, shuffle=False)
    first = ranks.step(samplers, batches=2)
    rest = ranks.step(samplers)
    assert_each_once(first + rest)


# -- set_epoch -----------------------------------------------------------------------------------


def test_set_epoch_of_the_same_epoch_keeps_progress(ranks):
    samplers = ranks.new_world(3, seed=5)
    ranks.set_epoch(samplers, 2)
    recorded = ranks.step(samplers, batches=2)
    before = samplers[0].state_dict()
    ranks.set_epoch(samplers, 2)
    assert samplers[0].state_dict() == before
    assert [len(s) for s in samplers] == [math.ceil((N - 30) / 3)] * 3
    recorded += ranks.step(samplers)
    assert_each_once(recorded)


def test_set_epoch_of_a_new_epoch_starts_over(ranks):
    samplers = ranks.new_world(3, seed=5)
    first_epoch = ranks.step(samplers)
    assert_each_once(first_epoch)
    ranks.set_epoch(samplers, 1)
    assert samplers[0].state_dict() == {"epoch": 1, "processed_indices": []}
    assert [len(s) for s in samplers] == [math.ceil(N / 3)] * 3
    assert_each_once(ranks.step(samplers))


def test_set_epoch_of_a_new_epoch_mid_epoch_drops_the_old_progress(ranks):
    samplers = ranks.new_world(2)
    ranks.step(samplers, batches=4)
    ranks.set_epoch(samplers, 1)
    assert_each_once(ranks.step(samplers))


def test_load_state_dict_takes_the_epoch_and_then_set_epoch_of_it_keeps_progress(ranks):
    world2 = ranks.new_world(2, seed=9)
    ranks.set_epoch(world2, 4)
    recorded = ranks.step(world2, batches=3)
    fresh = ranks.new_world(3, state=world2[0].state_dict(), seed=9)
    assert fresh[0].epoch == 4
    ranks.set_epoch(fresh, 4)
    recorded += ranks.step(fresh)
    assert_each_once(recorded)


# -- shuffle -------------------------------------------------------------------------------------


def order(ranks: Ranks, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    (sampler,) = ranks.new_world(1, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return list(iter(sampler))


def test_shuffled_order_is_a_permutation(ranks):
    assert sorted(order(ranks, 0, 0)) == list(range(N))
    assert order(ranks, 0, 0) != list(range(N))


def test_shuffled_order_is_deterministic_for_seed_and_epoch(ranks):
    assert order(ranks, 3, 2) == order(ranks, 3, 2)


def test_shuffled_order_changes_with_the_epoch(ranks):
    assert order(ranks, 0, 0) != order(ranks, 0, 1)


def test_shuffled_order_changes_with_the_seed(ranks):
    assert order(ranks, 0, 0) != order(ranks, 1, 0)


def test_shuffled_order_depends_on_seed_plus_epoch(ranks):
    assert order(ranks, 1, 2) == order(ranks, 3, 0) == order(ranks, 0, 3)


def test_unshuffled_order_is_the_dataset_order_every_epoch(ranks):
    assert order(ranks, 0, 0, shuffle=False) == list(range(N))
    assert order(ranks, 5, 3, shuffle=False) == list(range(N))


def test_every_rank_shards_the_same_shuffled_order(ranks):
    samplers = ranks.new_world(4, seed=11)
    streams = []
    for rank, s in enumerate(samplers):
        ranks.use(rank, 4)
        streams.append(list(iter(s)))
    interleaved = [streams[r][p] for p in range(26) for r in range(4)][:N]
    assert interleaved == order(ranks, 11, 0)


# -- state ---------------------------------------------------------------------------------------


def test_state_dict_lists_the_processed_indices_of_every_rank(ranks):
    samplers = ranks.new_world(4, shuffle=False)
    ranks.step(samplers, batches=1, batch_size=2)
    # each rank took the first two positions of its shard: ranks 0..3 hold 0..3, then 4..7
    for s in samplers:
        assert s.state_dict() == {"epoch": 0, "processed_indices": list(range(8))}


def test_sampler_outside_a_joined_world_is_rank_0_of_1(ranks):
    sampler = ElasticSampler(DATASET, shuffle=False)
    assert len(sampler) == N
    assert list(iter(sampler)) == list(range(N))


def test_empty_dataset_has_nothing_to_sample(ranks):
    samplers = ranks.new_world(3, dataset=[])
    assert [len(s) for s in samplers] == [0, 0, 0]
    assert ranks.step(samplers) == []
    assert samplers[0].state_dict() == {"epoch": 0, "processed_indices": []}
