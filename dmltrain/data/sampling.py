"""Batchers: class-level sampling over an endless group stream with bounded buffers of encoded images.

- `pk`: P classes x K images (Smooth-AP |P| = 4; RLL C-way K-shot), a pass over the data per epoch.
- `random`: whole classes at random until the batch is full (FastAP's "random" baseline).
- `hard`: FastAP's category pairs - half the batch from category a, half from b, where (a, b) is a pure
  function of (seed, global step), so every rank draws the same pair in the same step without talking.
- `vehicleid`: half from one labelled category, half from unlabelled classes (FastAP supplement A).
- `triplet`: Deep Ranking online sampling with per-category reservoirs (keys u^(1/r)).

Buffers hold encoded bytes, so memory is bounded by `pool_images` x the encoded image size. A batcher's
`state_dict` names buffered samples by (shard, member), small enough to travel with every batch.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import asdict, dataclass, fields
from itertools import combinations
from typing import Any

import numpy as np

from dmltrain.data.shards import Sample
from dmltrain.data.stream import Group, GroupStream

SAMPLERS = ("pk", "random", "hard", "vehicleid", "triplet")


@dataclass
class SamplerSpec:
    """How batches are built. Field names match the trainer's `sampler` config section where they overlap."""

    name: str = "pk"
    samples_per_class: int = 4
    pool_images: int | None = None  # buffered images per loader worker; None = max(8 x batch, 1024)
    batches_per_pair: int | None = None  # hard: None = the dataset's hint (SOP 5, In-Shop 2) or 1
    in_category_negatives: float = 0.5  # triplet: share of negatives from the query's own category
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in SAMPLERS:
            raise ValueError(f"sampler name {self.name!r} is not one of {SAMPLERS}")
        if self.samples_per_class < 2 and self.name == "pk":
            raise ValueError("pk sampling needs samples_per_class >= 2 (a class needs a positive pair)")

    @classmethod
    def from_config(cls, config: Any) -> SamplerSpec:
        """Build from any object or dict with some of these fields (e.g. the trainer's SamplerConfig)."""
        data = config if isinstance(config, dict) else getattr(config, "__dict__", {})
        if hasattr(config, "model_dump"):
            data = config.model_dump()
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def split_group(samples: list[Sample], k: int | None, counters: Counter[str]) -> list[list[Sample]]:
    """Cut a class group into parts of K (smaller classes whole); no part of one image, which has no positive.

    A remainder of one borrows from the last full part (K-1 + 2) when K >= 3, else it is counted as skipped.
    """
    n = len(samples)
    if n < 2:
        counters["skipped_single_images"] += n
        return []
    if k is None or n <= k:
        return [samples]
    q, r = divmod(n, k)
    parts = [samples[i * k : (i + 1) * k] for i in range(q)]
    tail = samples[q * k :]
    if r >= 2:
        parts.append(tail)
    elif r == 1:
        if k >= 3:
            last = parts.pop()
            parts += [last[: k - 1], last[k - 1 :] + tail]
        else:
            counters["skipped_single_images"] += 1
    return parts


def _refs(samples: list[Sample]) -> list[list[int]]:
    return [[s.shard, s.member] for s in samples]


def _lookup(refs: list[list[int]], found: dict[tuple[int, int], Sample]) -> list[Sample]:
    return [found[(int(a), int(b))] for a, b in refs]


class Batcher:
    """Common plumbing: the stream, the batch size, a seeded generator and counters of what was dropped."""

    def __init__(self, stream: GroupStream, batch_size: int, spec: SamplerSpec, seed: int) -> None:
        self.stream = stream
        self.batch_size = batch_size
        self.spec = spec
        self.rng = np.random.default_rng(seed)
        self.counters: Counter[str] = Counter()
        self.pool_images = spec.pool_images or max(8 * batch_size, 1024)

    def next_batch(self, step: int) -> list[Sample]:
        raise NotImplementedError

    def buffered_refs(self) -> list[list[int]]:
        raise NotImplementedError

    def _buffers_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def _load_buffers(self, state: dict[str, Any], samples: list[Sample]) -> None:
        """Rebuild the buffers from their recorded shape and the samples, in `buffered_refs` order."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {
            "rng": self.rng.bit_generator.state,
            "counters": dict(self.counters),
            "buffers": self._buffers_state(),
            "refs": self.buffered_refs(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.counters = Counter(state["counters"])
        found = self.stream.fetch([(int(a), int(b)) for a, b in state["refs"]])
        self._load_buffers(state["buffers"], _lookup(state["refs"], found))


class PoolBatcher(Batcher):
    """`pk` (parts of K) and `random` (whole classes): random distinct-class parts from a bounded pool."""

    def __init__(self, stream: GroupStream, batch_size: int, spec: SamplerSpec, seed: int) -> None:
        super().__init__(stream, batch_size, spec, seed)
        self.k = spec.samples_per_class if spec.name == "pk" else None
        self.pool: list[list[Sample]] = []
        self.size = 0

    def _ingest(self, group: Group) -> None:
        for part in split_group(group.samples, self.k, self.counters):
            self.pool.append(part)
            self.size += len(part)

    def _fill(self, target: int) -> None:
        while self.size < target:
            self._ingest(self.stream.next_group())

    def next_batch(self, step: int) -> list[Sample]:
        self._fill(self.pool_images)
        chosen: list[Sample] = []
        used: set[int] = set()
        for attempt in range(8):
            self._select(chosen, used, allow_single=attempt >= 4)
            if len(chosen) == self.batch_size:
                return chosen
            self._fill(self.size + self.batch_size)
        raise RuntimeError(
            f"could not fill a batch of {self.batch_size} from distinct classes: the pool of "
            f"{self.size} images has too few classes; raise pool_images or lower the batch size"
        )

    def _select(self, chosen: list[Sample], used: set[int], allow_single: bool) -> None:
        remaining = self.batch_size - len(chosen)
        taken: set[int] = set()
        for i in self.rng.permutation(len(self.pool)):
            if remaining == 0:
                break
            part = self.pool[i]
            cls, n = part[0].cls, len(part)
            if cls in used:
                continue
            if n <= remaining and (remaining - n != 1 or allow_single):
                chosen.extend(part)
                taken.add(int(i))
                remaining -= n
            elif n > remaining and (remaining >= 2 or allow_single):
                chosen.extend(part[:remaining])
                rest = part[remaining:]
                if len(rest) == 1:
                    self.counters["dropped_remainder_images"] += 1
                    taken.add(int(i))
                else:
                    self.pool[i] = rest
                remaining = 0
            else:
                continue
            used.add(cls)
        self.pool = [p for j, p in enumerate(self.pool) if j not in taken]
        self.size = sum(len(p) for p in self.pool)

    def buffered_refs(self) -> list[list[int]]:
        return [r for part in self.pool for r in _refs(part)]

    def _buffers_state(self) -> dict[str, Any]:
        return {"part_sizes": [len(p) for p in self.pool]}

    def _load_buffers(self, state: dict[str, Any], samples: list[Sample]) -> None:
        flat = iter(samples)
        self.pool = [[next(flat) for _ in range(n)] for n in state["part_sizes"]]
        self.size = sum(state["part_sizes"])


class _ShuffledRounds:
    """A fixed list of batch plans visited once per round, in an order seeded by (seed, salt, round), so
    every rank derives the same plan for a global step without communicating."""

    def __init__(self, entries: list[Any], seed: int, salt: int) -> None:
        self.entries = entries
        self.seed = seed
        self.salt = salt
        self.round_length = len(entries)
        self._cache: tuple[int, np.ndarray] | None = None

    def entry(self, step: int) -> Any:
        round_index, i = divmod(step, self.round_length)
        if self._cache is None or self._cache[0] != round_index:
            rng = np.random.default_rng([self.seed, self.salt, round_index])
            self._cache = (round_index, rng.permutation(self.round_length))
        return self.entries[int(self._cache[1][i])]


class PairSchedule(_ShuffledRounds):
    """FastAP epoch: every pair of categories `batches_per_pair` times, in a seeded order per round."""

    def __init__(self, categories: list[int], batches_per_pair: int, seed: int) -> None:
        if len(categories) < 2:
            raise ValueError(f"hard sampling needs at least 2 usable categories, got {categories}")
        self.pairs = list(combinations(sorted(categories), 2))
        self.batches_per_pair = batches_per_pair
        super().__init__([pair for pair in self.pairs for _ in range(batches_per_pair)], seed, salt=7)

    def at(self, step: int) -> list[tuple[int, float]]:
        """[(category, share of the batch)] for global step `step`."""
        a, b = self.entry(step)
        return [(a, 0.5), (b, 0.5)]


class CategorySchedule(_ShuffledRounds):
    """FastAP VehicleID epoch: labelled category c in round(2 N_c / M) batches (at least one), each
    paired with unlabelled classes (category -1)."""

    def __init__(self, category_images: dict[int, int], global_batch: int, seed: int) -> None:
        if not category_images:
            raise ValueError("vehicleid sampling needs labelled categories that every consumer holds")
        entries = [
            c
            for c in sorted(category_images)
            for _ in range(max(1, round(2 * category_images[c] / global_batch)))
        ]
        super().__init__(entries, seed, salt=11)

    def at(self, step: int) -> list[tuple[int, float]]:
        return [(self.entry(step), 0.5), (-1, 0.5)]


class ReservoirBatcher(Batcher):
    """`hard` and `vehicleid`: per-category buffers of class groups, filled from the stream, served on demand.

    Each step reads `batch_size` new images (so an epoch of steps reads about an epoch of data) and then
    serves the categories the shared schedule names. Unserved groups are preferred; served ones stay as
    a fallback for categories this consumer holds little of, and are evicted first when a buffer is full.
    """

    def __init__(
        self,
        stream: GroupStream,
        batch_size: int,
        spec: SamplerSpec,
        seed: int,
        schedule: PairSchedule | CategorySchedule,
        local_counts: dict[int, int],
    ) -> None:
        super().__init__(stream, batch_size, spec, seed)
        self.schedule = schedule
        total = max(1, sum(local_counts.values()))
        self.capacity = {
            c: max(batch_size, math.ceil(self.pool_images * n / total)) for c, n in local_counts.items()
        }
        # Reading ahead cannot find more of c than this consumer holds: stop once all of it is buffered.
        self.reachable = {c: min(self.capacity[c], n) for c, n in local_counts.items()}
        self.pass_images = total  # reading this far ahead has seen every image this consumer holds
        local_share = local_counts
        self.fresh: dict[int, list[list[Sample]]] = {c: [] for c in local_share}
        self.used: dict[int, deque[list[Sample]]] = {c: deque() for c in local_share}
        self.size: Counter[int] = Counter()

    def _ingest(self, group: Group) -> int:
        c = group.category
        if c not in self.fresh:  # a category outside the schedule (e.g. too rare to serve on every rank)
            self.counters["unscheduled_images"] += len(group.samples)
            return len(group.samples)
        if len(group.samples) < 2:
            self.counters["skipped_single_images"] += len(group.samples)
            return len(group.samples)
        self.fresh[c].append(group.samples)
        self.size[c] += len(group.samples)
        while self.size[c] > self.capacity[c]:
            if self.used[c]:
                dropped = self.used[c].popleft()
            else:
                dropped = self.fresh[c].pop(int(self.rng.integers(len(self.fresh[c]))))
                self.counters["evicted_unserved_images"] += len(dropped)
            self.size[c] -= len(dropped)
        return len(group.samples)

    def next_batch(self, step: int) -> list[Sample]:
        read = 0
        while read < self.batch_size:
            read += self._ingest(self.stream.next_group())
        plan = self.schedule.at(step)
        first = round(self.batch_size * plan[0][1])
        chosen = self._serve(plan[0][0], first)
        chosen += self._serve(plan[1][0], self.batch_size - len(chosen))
        if len(chosen) < self.batch_size:  # still short: the other category's fresh images then repeats
            chosen += self._serve(plan[0][0], self.batch_size - len(chosen), exclude={s.cls for s in chosen})
        if not chosen:
            raise RuntimeError(f"no images of categories {[c for c, _ in plan]} on this consumer")
        while len(chosen) < self.batch_size:
            self.counters["repeated_images"] += 1
            chosen.append(chosen[int(self.rng.integers(len(chosen)))])
        return chosen

    def _serve(self, c: int, need: int, exclude: set[int] | None = None) -> list[Sample]:
        """`need` images of category c from distinct classes: unserved groups first, then served ones."""
        out: list[Sample] = []
        classes = set(exclude or ())
        read_ahead = 0
        while (
            self._available(self.fresh[c], classes) < need
            and self.size[c] < self.reachable[c]
            and read_ahead < self.pass_images
        ):
            read_ahead += self._ingest(self.stream.next_group())
        for source in (self.fresh[c], self.used[c]):
            for i in self.rng.permutation(len(source)):
                if len(out) >= need:
                    break
                group = source[i]
                if group[0].cls in classes:
                    continue
                out.extend(group[: need - len(out)])
                classes.add(group[0].cls)
        served = {g[0].cls for g in self.fresh[c] if g[0].cls in classes}
        moved = [g for g in self.fresh[c] if g[0].cls in served]
        self.fresh[c] = [g for g in self.fresh[c] if g[0].cls not in served]
        self.used[c].extend(moved)
        return out

    @staticmethod
    def _available(groups: list[list[Sample]], exclude: set[int]) -> int:
        return sum(len(g) for g in groups if g[0].cls not in exclude)

    def buffered_refs(self) -> list[list[int]]:
        refs = []
        for c in sorted(self.fresh):
            for g in [*self.fresh[c], *self.used[c]]:
                refs += _refs(g)
        return refs

    def _buffers_state(self) -> dict[str, Any]:
        return {
            str(c): {"fresh": [len(g) for g in self.fresh[c]], "used": [len(g) for g in self.used[c]]}
            for c in sorted(self.fresh)
        }

    def _load_buffers(self, state: dict[str, Any], samples: list[Sample]) -> None:
        flat = iter(samples)
        self.size = Counter()
        for c in sorted(self.fresh):
            sizes = state[str(c)]
            self.fresh[c] = [[next(flat) for _ in range(n)] for n in sizes["fresh"]]
            self.used[c] = deque([next(flat) for _ in range(n)] for n in sizes["used"])
            self.size[c] = sum(sizes["fresh"]) + sum(sizes["used"])


class TripletBatcher(Batcher):
    """Deep Ranking Alg. 1: each incoming image enters its category's reservoir (key u^(1/r), r = 1 here:
    plain class labels carry no graded relevance) and then yields one triplet from that reservoir: a query,
    a positive of the same class, and a negative from the same category (share `in_category_negatives`)
    or from the other reservoirs. The batch is [q0, p0, n0, q1, p1, n1, ...].

    Alg. 1 reads a stream of single images, but the group stream delivers whole classes in a row; fed
    directly, a batch's queries would come from the 3-4 classes just read. Incoming images are therefore
    drawn at random from a window of `mix_images` buffered images (many classes), which restores an
    image-level stream order.
    """

    def __init__(
        self,
        stream: GroupStream,
        batch_size: int,
        spec: SamplerSpec,
        seed: int,
        local_share: dict[int, float],
    ) -> None:
        super().__init__(stream, batch_size, spec, seed)
        if batch_size % 3:
            raise ValueError(
                f"triplet batches hold whole triplets: batch size {batch_size} is not a multiple of 3"
            )
        self.capacity = {c: max(16, math.ceil(self.pool_images * s)) for c, s in local_share.items()}
        self.buffers: dict[int, list[Sample]] = {}
        self.keys: dict[int, list[float]] = {}
        self.pending: list[Sample] = []  # the mixing window of incoming images
        self.mix_images = max(batch_size, self.pool_images // 2)

    def _insert(self, sample: Sample) -> int:
        c = sample.category
        buf, keys = self.buffers.setdefault(c, []), self.keys.setdefault(c, [])
        key = float(self.rng.random()) ** (1.0 / 1.0)  # u^(1/r) with relevance r = 1
        if len(buf) < self.capacity.get(c, 16):
            buf.append(sample)
            keys.append(key)
        else:
            low = int(np.argmin(keys))
            if key > keys[low]:
                buf[low], keys[low] = sample, key
        return c

    def _triplet(self, c: int, tries: int = 20) -> list[Sample] | None:
        buf = self.buffers[c]
        others = [o for o in sorted(self.buffers) if o != c and self.buffers[o]]
        for _ in range(tries):
            query = buf[int(self.rng.integers(len(buf)))]
            positives = [s for s in buf if s.cls == query.cls and s is not query]
            if not positives:
                continue
            positive = positives[int(self.rng.integers(len(positives)))]
            same = [s for s in buf if s.cls != query.cls]
            if same and (not others or self.rng.random() < self.spec.in_category_negatives):
                negative = same[int(self.rng.integers(len(same)))]
            elif others:
                sizes = np.array([len(self.buffers[o]) for o in others], dtype=float)
                pick = others[int(self.rng.choice(len(others), p=sizes / sizes.sum()))]
                negative = self.buffers[pick][int(self.rng.integers(len(self.buffers[pick])))]
            else:
                continue
            return [query, positive, negative]
        self.counters["images_without_triplet"] += 1
        return None

    def _next_image(self) -> Sample:
        """A random image of the mixing window, refilled with whole groups from the stream."""
        while len(self.pending) < self.mix_images:
            self.pending.extend(self.stream.next_group().samples)
        i = int(self.rng.integers(len(self.pending)))
        self.pending[i], self.pending[-1] = self.pending[-1], self.pending[i]
        return self.pending.pop()

    def next_batch(self, step: int) -> list[Sample]:
        out: list[Sample] = []
        while len(out) < self.batch_size:
            triplet = self._triplet(self._insert(self._next_image()))
            if triplet:
                out.extend(triplet)
        return out

    def buffered_refs(self) -> list[list[int]]:
        refs = []
        for c in sorted(self.buffers):
            refs += _refs(self.buffers[c])
        return refs + _refs(self.pending)

    def _buffers_state(self) -> dict[str, Any]:
        return {
            "sizes": {str(c): len(self.buffers[c]) for c in sorted(self.buffers)},
            "keys": {str(c): list(self.keys[c]) for c in sorted(self.buffers)},  # a copy: the lists change
            "pending": len(self.pending),
        }

    def _load_buffers(self, state: dict[str, Any], samples: list[Sample]) -> None:
        flat = iter(samples)
        self.buffers = {int(c): [next(flat) for _ in range(n)] for c, n in state["sizes"].items()}
        self.keys = {int(c): list(k) for c, k in state["keys"].items()}
        self.pending = [next(flat) for _ in range(state["pending"])]
