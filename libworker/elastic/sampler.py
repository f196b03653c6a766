"""ElasticSampler: shards an epoch over the current world and never repeats or skips a sample across resets.

All ranks consume their shards in lockstep (one batch per step), so the
indices every rank has processed follow from one count: after `consumed`
positions, rank r has processed `shard_r[:consumed]`. Each rank therefore knows
the global set of processed indices without any communication, and so does its
saved state, even for ranks that have since left or died. On reset the
unprocessed rest of the epoch is re-sharded over the new world.

Shards differ in length by at most one; the shorter ones are padded (with
already-assigned indices) so every rank takes the same number of steps.
Padding is never recorded as processed: `record_batch` returns only the real
indices of the batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from libworker.world import world


class ElasticSampler(Sampler[int]):
    def __init__(self, dataset: Sized, shuffle: bool = True, seed: int = 0) -> None:
        self.length = len(dataset)
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_before: set[int] = set()
        self.remaining: list[int] = []
        self.size = 1
        self.consumed = 0
        self.reset()

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.length))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def reset(self) -> None:
        """Re-shard what is left of the epoch over the current world (rank and size from the joined round)."""
        self.processed_before = self.processed_indices
        self.rank = int(world.slot.get("rank", 0))
        self.size = int(world.slot.get("size", 1))
        self.remaining = [i for i in self._order() if i not in self.processed_before]
        self.num_samples = math.ceil(len(self.remaining) / self.size) if self.remaining else 0
        self.consumed = 0
        self.iter_start = 0

    def _shard(self, rank: int) -> list[int]:
        return self.remaining[rank :: self.size]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch`; calling it again for the current epoch (after a reset) keeps its progress."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed_before = set()
            self.consumed = 0
        self.reset()

    @property
    def processed_indices(self) -> set[int]:
        done = set(self.processed_before)
        for rank in range(self.size):
            done.update(self._shard(rank)[: self.consumed])
        return done

    def record_batch(self, batch_idx: int, batch_size: int) -> list[int]:
        """Record that batch `batch_idx` of the current iteration was processed; return its real indices."""
        start = self.iter_start + batch_idx * batch_size
        end = min(self.iter_start + (batch_idx + 1) * batch_size, self.num_samples)
        self.consumed = max(self.consumed, end)
        return self._shard(self.rank)[start:end]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.processed_before = set(state["processed_indices"])
        self.consumed = 0
        self.reset()

    def __iter__(self) -> Iterator[int]:
        self.iter_start = self.consumed
        shard = self._shard(self.rank)
        positions = range(self.consumed, self.num_samples)
        return iter([shard[p] if p < len(shard) else self.remaining[p % len(self.remaining)] for p in positions])

    def __len__(self) -> int:
        return self.num_samples - self.consumed
