"""Per-consumer streaming: which shards a (rank, loader worker) reads, and the endless stream of class groups.

A consumer is one DataLoader worker of one rank. Shard i goes to rank i mod ranks, and a rank's shards are
dealt over its loader workers in turn: a fixed assignment computable from `dataset.json` alone, so every
process knows what every other one holds (the batch plan needs that) without communication, and ranks
hold within one shard of the same data whatever the number of loader workers. Each consumer reads its
shards over and over (a new seeded order per pass), so no rank ever runs dry: the number of steps per
epoch is a plan, not a property of the data a rank happens to hold.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from dmltrain.data.cache import ShardCache
from dmltrain.data.shards import Sample, read_shard


@dataclass
class Group:
    """Consecutive images of one class from one shard (the writer keeps a class's images together)."""

    cls: int
    category: int
    samples: list[Sample]


def resolve_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world size): explicit values, else Ray Train's context, torch.distributed, RANK/WORLD_SIZE."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None:
            raise ValueError("give both rank and world_size, or neither")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1}")
        return rank, world_size
    if "ray" in sys.modules:
        try:
            import ray.train

            context = ray.train.get_context()
            return context.get_world_rank(), context.get_world_size()
        except Exception:  # not inside a Ray Train worker
            pass
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def rank_shards(num_shards: int, rank: int, world_size: int) -> list[int]:
    """Shard indices of `rank` (round-robin, so the writer's category dealing carries over to ranks)."""
    return list(range(rank, num_shards, world_size))


def consumer_shards(num_shards: int, rank: int, world_size: int, worker: int, workers: int) -> list[int]:
    """Shard indices read by loader worker `worker` of `rank`: every `workers`-th of the rank's shards."""
    return rank_shards(num_shards, rank, world_size)[worker::workers]


class GroupStream:
    """Endless stream of class groups from one consumer's shards, resumable from a small position record."""

    def __init__(
        self,
        urls: list[str],
        shard_ids: list[int],
        seed: int,
        consumer: int,
        counts: list[int] | None = None,
        cache: ShardCache | None = None,
        class_counts: list[list[tuple[int, int]]] | None = None,
    ) -> None:
        """``cache``: shards read whole are kept there and replayed from memory on later passes.
        ``counts`` / ``class_counts``: each shard's samples and (class, images) as dataset.json lists them,
        checked as the shard is read."""
        if not shard_ids:
            raise ValueError(f"consumer {consumer} has no shard to read")
        self.urls = urls
        self.counts = counts  # samples per shard from dataset.json: a shard holding fewer is an error
        self.class_counts = class_counts
        self.cache = cache
        self.shard_ids = shard_ids
        self.seed = seed
        self.consumer = consumer
        self.epoch = 0  # passes over this consumer's shards completed
        self.pos = 0  # index into this pass's shard order
        self.offset = 0  # samples of the current shard already handed out in groups
        self._reader: Iterator[Sample] | None = None
        self._pending: Sample | None = None
        self._order_cache: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, self.consumer, epoch])
            self._order_cache = (epoch, [self.shard_ids[i] for i in rng.permutation(len(self.shard_ids))])
        return self._order_cache[1]

    def next_group(self) -> Group:
        empty_shards = 0
        while True:
            if self._reader is None:
                self._reader = self._open(self.order(self.epoch)[self.pos])
                self._pending = None
            samples: list[Sample] = []
            if self._pending is not None:
                samples.append(self._pending)
                self._pending = None
            for sample in self._reader:
                if samples and sample.cls != samples[0].cls:
                    self._pending = sample
                    break
                samples.append(sample)
            if samples:
                self.offset += len(samples)
                if self._pending is None:
                    self._next_shard()
                return Group(samples[0].cls, samples[0].category, samples)
            self._next_shard()
            empty_shards += 1
            if empty_shards > len(self.shard_ids):
                raise ValueError(f"every shard of consumer {self.consumer} is empty: {self.shard_ids}")

    def _open(self, shard: int) -> Iterator[Sample]:
        """``shard``'s samples from ``self.offset`` on: from the cache, or read (and kept if read whole)."""
        kept = self.cache.shard(shard) if self.cache is not None else None
        if kept is not None:
            return iter(kept[self.offset :])
        classes = self.class_counts[shard] if self.class_counts is not None else None
        reader = read_shard(
            self.urls[shard],
            shard=shard,
            skip=self.offset,
            expected=self._expected(shard),
            class_counts=classes,
        )
        if self.cache is not None and self.cache.enabled and self.offset == 0:
            return self._recorded(shard, reader)
        return reader

    def _recorded(self, shard: int, reader: Iterator[Sample]) -> Iterator[Sample]:
        """Pass ``reader`` through; once it has yielded the whole shard (its count checked), keep it."""
        samples = []
        for sample in reader:
            samples.append(sample)
            yield sample
        assert self.cache is not None
        self.cache.keep_shard(shard, samples)

    def _expected(self, shard: int) -> int | None:
        return self.counts[shard] if self.counts is not None else None

    def _next_shard(self) -> None:
        self._reader = None
        self._pending = None
        self.offset = 0
        self.pos += 1
        if self.pos == len(self.shard_ids):
            self.pos = 0
            self.epoch += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "offset": self.offset}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos, self.offset = int(state["epoch"]), int(state["pos"]), int(state["offset"])
        self._reader = None
        self._pending = None

    def fetch(self, refs: list[tuple[int, int]]) -> dict[tuple[int, int], Sample]:
        """Re-read buffered samples named by (shard, member) when a checkpointed sampler is restored."""
        wanted: dict[int, set[int]] = {}
        for shard, member in refs:
            wanted.setdefault(shard, set()).add(member)
        found: dict[tuple[int, int], Sample] = {}
        for shard, members in wanted.items():
            last = max(members)
            for sample in read_shard(self.urls[shard], shard=shard):
                if sample.member in members:
                    found[(shard, sample.member)] = sample
                if sample.member >= last:
                    break
        missing = set(refs) - set(found)
        if missing:
            raise ValueError(
                f"checkpointed samples not found in the shards (data changed?): {sorted(missing)[:5]}"
            )
        return found
