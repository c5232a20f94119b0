"""The batch plan: which shards each consumer reads, how a local batch splits into the parts its loader
workers fill, what each part holds in each step, and whether the data can fill the batch at all.

A consumer is one DataLoader worker of one rank. A rank's local batch draws on ALL of that rank's classes:
every loader worker contributes a part from its own classes, sized by what it holds, and the loader's
main process joins the parts of a step. So a global batch of B images at K per class forms whenever each
rank's classes can fill its share (B/K <= the train classes, up to how evenly shards spread over ranks),
whatever the number of loader workers. Everything here follows from dataset.json and the layout alone, so
every process computes the same plan without talking, and the hard/vehicleid quotas of a step are a pure
function of (seed, global step).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from functools import reduce
from itertools import combinations
from typing import Any

import numpy as np

from dmltrain.data.metadata import DatasetInfo, ShardInfo
from dmltrain.data.sampling import Quota, SamplerSpec, largest_piece
from dmltrain.data.stream import consumer_shards


class BatchError(ValueError):
    """A batch the data cannot fill, found from dataset.json alone: one line naming the keys and numbers."""


def check_enough_shards(split: str, num_shards: int, world_size: int, workers: int) -> None:
    """Fail before any process starts when some consumer would get no shard (it would hang the others)."""
    consumers = world_size * workers
    if num_shards < consumers:
        raise BatchError(
            f"split {split!r} has {num_shards} shard(s) but {world_size} rank(s) x {workers} loader "
            f"worker(s) = {consumers} consumers need at least one each: re-run `dmltrain prepare` with a "
            f"smaller --shard-size, or lower data.loader_workers"
        )


_PHASES = 1 << 16
_WEIGHT_SCALE = 1 << 10  # integer apportioning weights from fractional capacities


def phase(step: int) -> int:
    """A rounding phase in [0, 2^16) for global step `step`: the golden-ratio sequence, so that over steps
    every part's rounding comes out at its exact proportional share (no worker always rounds down)."""
    return (step * 40503) % _PHASES


def apportion(total: int, weights: list[int], caps: list[int], unit: int = 1, shift: int = 0) -> list[int]:
    """Split `total` images into parts proportional to `weights`, none above its cap, each a multiple of
    `unit` where units can add up to `total` (else single images), and no part of one image where that
    can be avoided (it would have no positive). Fractions are rounded systematically at phase
    `shift` / 2^16 (see `phase`). Integer arithmetic: every process gets the same split."""
    n = len(weights)
    if total <= 0:
        return [0] * n
    if sum(caps) < total:
        raise ValueError(f"cannot place {total} images in parts capped at {caps}")
    if unit > 1 and (total % unit or sum(c // unit for c in caps) * unit < total):
        unit = 1
    left = total // unit
    cap = [c // unit for c in caps]
    weight = [max(0, w) if cap[i] > 0 else 0 for i, w in enumerate(weights)]
    if not any(weight):
        weight = [1 if c > 0 else 0 for c in cap]
    parts = [0] * n
    free = [i for i in range(n) if weight[i] > 0]
    while free:  # water-filling: parts whose proportional share exceeds their cap are set to the cap
        wsum = sum(weight[i] for i in free)
        over = [i for i in free if left * weight[i] > cap[i] * wsum]
        if not over:
            break
        for i in over:
            parts[i] = cap[i]
            left -= cap[i]
        free = [i for i in free if i not in over]
    if free:
        # Systematic rounding: part i gets the points k + shift/2^16 (k integer) that fall in its slice
        # [C_{i-1}, C_i) of [0, left), where C_i = left * (cumulative weight) / wsum.
        wsum = sum(weight[i] for i in free)
        scale = wsum * _PHASES
        cumulative, below = 0, 0
        for i in free:
            cumulative += weight[i]
            upto = -(-(left * cumulative * _PHASES - shift * wsum) // scale)  # ceil(C_i - phase)
            parts[i] = upto - below
            below = upto
    else:  # every weighted part is full: the rest goes where there is room, in order
        for i in range(n):
            extra = min(left, cap[i] - parts[i])
            parts[i] += extra
            left -= extra
    parts = [p * unit for p in parts]
    if unit == 1:
        _no_single_images(parts, caps)
    return parts


def _no_single_images(parts: list[int], caps: list[int]) -> None:
    for i, p in enumerate(parts):
        if p != 1:
            continue
        donor = max(
            (j for j in range(len(parts)) if j != i and parts[j] >= 3), key=parts.__getitem__, default=None
        )
        if caps[i] >= 2 and donor is not None:
            parts[donor] -= 1
            parts[i] += 1
            continue
        other = next((j for j in range(len(parts)) if j != i and parts[j] == 1), None)
        if other is not None and (caps[i] >= 2 or caps[other] >= 2):  # two single images: one pair
            keep, drop = (i, other) if caps[i] >= 2 else (other, i)
            parts[keep], parts[drop] = 2, 0
            continue
        room = [j for j in range(len(parts)) if j != i and parts[j] >= 2 and parts[j] < caps[j]]
        if room:
            parts[room[0]] += 1
            parts[i] = 0


def _even_split(total: int, lo: list[int], hi: list[int], unit: int, shift: int) -> list[int]:
    """`total` split as evenly as possible over parts bounded by [lo, hi] (lo <= hi, sum(lo) <= total <=
    sum(hi)): an even split capped at hi, then parts below lo raised, taking from the largest parts."""
    parts = apportion(total, [1] * len(hi), hi, unit, shift)
    for i in range(len(parts)):
        while parts[i] < lo[i]:
            j = max((j for j in range(len(parts)) if parts[j] > lo[j]), key=lambda j: parts[j] - lo[j])
            move = min(lo[i] - parts[i], parts[j] - lo[j])
            parts[i] += move
            parts[j] -= move
    return parts


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
    """FastAP epoch: every category pair `batches_per_pair` times, in a seeded order per round."""

    def __init__(self, pairs: list[tuple[int, int]], batches_per_pair: int, seed: int) -> None:
        if not pairs:
            raise ValueError("hard sampling needs at least one pair of categories that fills a batch")
        self.pairs = sorted(pairs)
        self.batches_per_pair = batches_per_pair
        super().__init__([pair for pair in self.pairs for _ in range(batches_per_pair)], seed, salt=7)

    def at(self, step: int) -> tuple[int, int]:
        """The two categories of global step `step`."""
        return self.entry(step)


class CategorySchedule(_ShuffledRounds):
    """FastAP VehicleID epoch: labelled category c in round(2 N_c / M) batches (at least one), each
    paired with unlabelled classes (category -1)."""

    def __init__(self, category_images: dict[int, int], global_batch: int, seed: int) -> None:
        if not category_images:
            raise ValueError("vehicleid sampling needs labelled categories")
        entries = [
            c
            for c in sorted(category_images)
            for _ in range(max(1, round(2 * category_images[c] / global_batch)))
        ]
        super().__init__(entries, seed, salt=11)

    def at(self, step: int) -> tuple[int, int]:
        return self.entry(step), -1


@dataclass
class Holding:
    """What one consumer's shards hold, from dataset.json."""

    shards: list[int]
    images: int = 0
    runs: dict[int, int] = field(default_factory=dict)  # class -> its most images in one of the shards
    categories: dict[int, int] = field(default_factory=dict)  # category -> images (single ones included)
    whole: dict[int, int] = field(default_factory=dict)  # category -> images in classes of 2+ (largest runs)

    @property
    def classes(self) -> int:
        """Classes of 2+ images: those a batch can use."""
        return sum(1 for n in self.runs.values() if n >= 2)


def _class_holders(holdings: list[Holding], counted: list[bool]) -> dict[int, list[int]]:
    """class -> the consumers (of those ``counted``) that hold 2+ images of it in one shard, in order."""
    holders: dict[int, list[int]] = {}
    for consumer, held in enumerate(holdings):
        if counted[consumer]:
            for cls, n in held.runs.items():
                if n >= 2:
                    holders.setdefault(cls, []).append(consumer)
    return holders


def _holding(info: DatasetInfo, shards: list[ShardInfo], ids: list[int]) -> Holding:
    held = Holding(ids)
    for i in ids:
        held.images += shards[i].num_samples
        for cls, n in shards[i].class_counts:
            held.runs[cls] = max(held.runs.get(cls, 0), n)
        for c, n in shards[i].category_counts or [(-1, shards[i].num_samples)]:
            held.categories[c] = held.categories.get(c, 0) + n
    for cls, n in held.runs.items():
        if n >= 2:
            c = info.class_to_category[cls] if cls < len(info.class_to_category) else -1
            held.whole[c] = held.whole.get(c, 0) + n
    return held


class TrainPlan:
    """Everything derivable from dataset.json and the layout, identical in every process: the shards and
    holdings of each consumer, the part each one fills in each step, the schedule, the steps per epoch.
    Raises `BatchError` for a batch the data cannot fill; `where` names the data in messages."""

    def __init__(
        self,
        info: DatasetInfo,
        split: str,
        spec: SamplerSpec,
        batch_size: int,
        world_size: int,
        workers: int,
        where: str | None = None,
    ) -> None:
        split_info = info.split(split)
        shards = split_info.shards
        check_enough_shards(split, len(shards), world_size, workers)
        self.info, self.split, self.spec = info, split, spec
        self.where = where or repr(info.name)
        self.batch_size = batch_size
        self.world_size, self.workers = world_size, workers
        self.consumers = world_size * workers
        self.global_batch = batch_size * world_size
        self.shard_samples = [s.num_samples for s in shards]
        self.shard_classes = [s.class_counts for s in shards]
        self.holdings = [
            _holding(info, shards, consumer_shards(len(shards), r, world_size, w, workers))
            for r in range(world_size)
            for w in range(workers)
        ]
        self._warn_rank_imbalance(len(shards))
        self.parts: list[int] | None = None  # fixed part of each consumer (pk, random, triplet)
        self.capacity: list[int] = [h.images for h in self.holdings]
        self.schedule: PairSchedule | CategorySchedule | None = None
        self.holders: dict[int, tuple[int, ...]] = {}  # pk/random: the consumers of each shared class
        self.excluded_categories: list[int] = []
        self._quotas: dict[tuple[int, int, int], list[Quota]] = {}
        usable = split_info.num_samples - len(split_info.singleton_classes)
        if spec.name in ("pk", "random"):
            self._plan_pool(split_info.num_classes - len(split_info.singleton_classes))
            self.steps_per_epoch = max(1, usable // self.global_batch)
        elif spec.name == "triplet":
            self._plan_triplet()
            self.steps_per_epoch = max(1, usable // (world_size * (batch_size // 3)))
        else:
            if not info.category_names:
                raise BatchError(f"sampler.name={spec.name} needs category labels; {self.where} has none")
            if self.global_batch % 2:
                raise BatchError(
                    f"sampler.name={spec.name} splits train.global_batch_size={self.global_batch} in two "
                    f"halves: make it even"
                )
            self.totals = {c: sum(h.whole.get(c, 0) for h in self.holdings) for c in self._all_categories()}
            self.units = self._units()
            if spec.name == "hard":
                self._plan_hard()
            else:
                self._plan_vehicleid()
            assert self.schedule is not None
            self.steps_per_epoch = self.schedule.round_length

    # ------------------------------------------------------------------ per consumer
    def rank_of(self, consumer: int) -> tuple[int, int]:
        """(rank, loader worker) of a consumer index."""
        return divmod(consumer, self.workers)

    def name(self, consumer: int) -> str:
        r, w = self.rank_of(consumer)
        return f"rank {r} loader worker {w}"

    def quota(self, step: int, consumer: int) -> Quota:
        """(category, images) that `consumer` contributes to global step `step`; None = any category."""
        if self.parts is not None:
            return [(None, self.parts[consumer])]
        assert self.schedule is not None
        return self._pair_quotas(*self.schedule.at(step), phase(step))[consumer]

    def typical_part(self, consumer: int) -> int:
        if self.parts is not None:
            return self.parts[consumer]
        return max(1, round(self.batch_size * self.holdings[consumer].images / self._rank_images(consumer)))

    def largest_quota(self, consumer: int) -> dict[int, int]:
        """Per scheduled category, the most images `consumer` serves of it in one step (its buffer size)."""
        assert self.schedule is not None
        out: dict[int, int] = {}
        whole = self.holdings[consumer].whole
        for entry in sorted(set(self.schedule.entries)):
            pair = entry if isinstance(entry, tuple) else (entry, -1)
            quota = dict(self._pair_quotas(*pair, 0)[consumer])
            for c in pair:
                if whole.get(c, 0) > 0:  # another phase rounds each level by at most one unit more
                    n = min(whole[c], quota.get(c, 0) + 2 * self.units.get(c, 1))
                    out[c] = max(out.get(c, 0), n)
        return out

    def local_share(self, consumer: int) -> dict[int, float]:
        counts = self.holdings[consumer].categories
        total = max(1, sum(counts.values()))
        return {c: n / total for c, n in counts.items()}

    # ------------------------------------------------------------------ samplers
    def _plan_pool(self, train_classes: int) -> None:
        """pk / random: fixed parts proportional to what each worker can give one batch."""
        pk = self.spec.name == "pk"
        k = self.spec.samples_per_class if pk else None
        big, b = self.global_batch, self.batch_size
        if pk and math.ceil(big / k) > train_classes:
            raise BatchError(
                f"train.global_batch_size={big} / sampler.samples_per_class={k} = {math.ceil(big / k)} "
                f"classes per batch, but {self.where} has {train_classes} train classes (of 2+ images)"
            )
        self.capacity = [sum(largest_piece(n, k) for n in h.runs.values()) for h in self.holdings]
        held_by = _class_holders(self.holdings, [True] * len(self.holdings))
        ranks = [self._rank_slice(r) for r in range(self.world_size)]
        rank_caps = [sum(self.capacity[s]) for s in ranks]
        for r, cap in enumerate(rank_caps):
            if b > cap:
                classes = sum(h.classes for h in self.holdings[ranks[r]])
                what = (
                    f"at most sampler.samples_per_class={k} of a class"
                    if pk
                    else "sampler.name=random takes whole classes"
                )
                raise BatchError(
                    f"train.global_batch_size={big} over scaling.num_workers={self.world_size} is {b} images "
                    f"per rank from distinct classes ({what}), but rank {r}'s shards of {self.where} hold "
                    f"{classes} train classes giving at most {cap}: lower train.global_batch_size to "
                    f"{self.world_size * min(rank_caps)} or less"
                )
        unit = k if pk and k else reduce(math.gcd, self._units().values(), 0) or 1
        # Weighted by what a consumer gives on its turns (a shared class counts 1/holders), capped by all.
        expected = [
            round(
                _WEIGHT_SCALE * sum(largest_piece(n, k) / len(held_by.get(c, [0])) for c, n in h.runs.items())
            )
            for h in self.holdings
        ]
        self.parts = [p for s in ranks for p in apportion(b, expected[s], self.capacity[s], unit)]
        # Turns among the consumers that fill a part: a turn of one without would be lost.
        served = _class_holders(self.holdings, [part > 0 for part in self.parts])
        self._plan_turns(served)
        unserved = held_by.keys() - served.keys()
        if unserved:
            warnings.warn(
                f"split {self.split!r}: {len(unserved)} train classes are held only by loader workers whose "
                f"part of the batch is 0 ({b} images per rank, in units of {unit}, over {self.workers} "
                "loader workers): they are never sampled; lower data.loader_workers",
                stacklevel=4,
            )

    def _plan_turns(self, holders: dict[int, list[int]]) -> None:
        """The consumers of each class that more than one of them holds (``holders``: `_class_holders`): a
        class larger than `prepare`'s group size is dealt over several shards, and each holder filling its
        part from its own classes put such a class into one global batch twice or more (CUB at K=3 on 2 x 4
        consumers: 35 of 50 batches). In a step only the holder on turn (`on_turn`) offers it."""
        self.holders = {cls: tuple(found) for cls, found in holders.items() if len(found) > 1}
        # Classes of the same holders take turns in a cycle (offsets 0, 1, 2, ...): in every step each of
        # those holders offers an equal share of them, give or take one.
        self._turn_offsets: dict[int, int] = {}
        seen: dict[tuple[int, ...], int] = {}
        for cls in sorted(self.holders):
            group = self.holders[cls]
            self._turn_offsets[cls] = seen.get(group, 0)
            seen[group] = self._turn_offsets[cls] + 1

    def turns(self, consumer: int) -> dict[int, tuple[int, int, int]]:
        """class -> (this consumer's position among its holders, holders, the class's turn offset), for
        the classes it shares with other consumers (`dmltrain.data.sampling.on_turn`)."""
        return {
            cls: (found.index(consumer), len(found), self._turn_offsets[cls])
            for cls, found in self.holders.items()
            if consumer in found
        }

    def _plan_triplet(self) -> None:
        big, b = self.global_batch, self.batch_size
        if b % 3:
            raise BatchError(
                f"sampler.name=triplet builds batches of whole triplets, but train.global_batch_size={big} / "
                f"scaling.num_workers={self.world_size} = {b} images per rank is not a multiple of 3"
            )
        self.parts = []
        for r in range(self.world_size):
            held = self.holdings[self._rank_slice(r)]
            self.parts += apportion(b, [h.images for h in held], [b] * len(held), 3)
        for consumer, (h, part) in enumerate(zip(self.holdings, self.parts, strict=True)):
            if part and (h.classes < 1 or len(h.runs) < 2):
                raise BatchError(
                    f"sampler.name=triplet: {self.name(consumer)} holds {len(h.runs)} class(es), "
                    f"{h.classes} of 2+ images, but a triplet needs a class of 2+ images and another class: "
                    f"lower data.loader_workers or prepare smaller shards"
                )

    def _plan_hard(self) -> None:
        """FastAP pairs: every pair of categories that can fill a batch, half from each where it can."""
        big, half = self.global_batch, self.global_batch // 2
        labelled = {c: n for c, n in self.totals.items() if c >= 0 and n >= 2}
        enough = [c for c in labelled if labelled[c] >= half]
        if len(enough) < 2:
            top = sorted(labelled, key=lambda c: (-labelled[c], c))[:2]
            largest = ", ".join(f"{self.info.category_names[c]!r} {labelled[c]}" for c in top) or "none"
            raise BatchError(
                f"sampler.name=hard takes half of train.global_batch_size={big} = {half} images from each of "
                f"two categories, but {len(enough)} of the {len(labelled)} train categories of {self.where} "
                f"hold that many in classes of 2+ images (largest: {largest})"
            )
        pairs = [(a, b) for a, b in combinations(sorted(labelled), 2) if labelled[a] + labelled[b] >= big]
        paired = {c for pair in pairs for c in pair}
        self._warn_categories(sorted(set(labelled) - paired), "no partner to fill a batch with")
        small = sorted(c for c in paired if labelled[c] < half)
        self._warn_categories(
            small,
            f"fewer than half a batch ({half}) images: their batches take all of them "
            f"and the partner category fills the rest",
            exclude=False,
        )
        hint = self.info.sampling_hints.get("batches_per_pair", 1)
        per_pair = self.spec.batches_per_pair or int(hint)
        self.schedule = PairSchedule(pairs, per_pair, self.spec.seed)

    def _plan_vehicleid(self) -> None:
        """FastAP VehicleID: one labelled model and unlabelled vehicles; a model smaller than half a
        batch gives all its images and the unlabelled half grows to fill the batch."""
        big, half = self.global_batch, self.global_batch // 2
        unlabelled = self.totals.get(-1, 0)
        if unlabelled < half:
            raise BatchError(
                f"sampler.name=vehicleid fills half of train.global_batch_size={big} = {half} images from "
                f"unlabelled vehicles (category -1), but {self.where} has {unlabelled} in classes of 2+ "
                f"images"
            )
        labelled = {c: n for c, n in self.totals.items() if c >= 0 and n >= 2}
        served = {c: n for c, n in labelled.items() if n + unlabelled >= big}
        if not served:
            raise BatchError(
                f"sampler.name=vehicleid needs a labelled category with 2+ images of a class; {self.where} "
                f"has none that, with its {unlabelled} unlabelled images, fills train.global_batch_size={big}"
            )
        self._warn_categories(
            sorted(set(labelled) - set(served)), "too few images, with the unlabelled ones, to fill a batch"
        )
        small = sorted(c for c in served if served[c] < half)
        self._warn_categories(
            small,
            f"fewer than half a batch ({half}) images: their batches take all of them "
            f"and unlabelled vehicles fill the rest",
            exclude=False,
        )
        self.schedule = CategorySchedule(served, big, self.spec.seed)

    def _pair_quotas(self, a: int, b: int, shift: int) -> list[Quota]:
        """Each consumer's (category, images) for a step of pair (a, b): the global totals split evenly
        over ranks within what each rank holds (half each on every rank where it can), then over each
        rank's workers in
        proportion to what they hold; whatever a rank cannot take from a or b comes from any category.
        `shift` is the step's rounding phase."""
        cached = self._quotas.get((a, b, shift))
        if cached is not None:
            return cached
        total_a = self._pair_total(a, b)
        unit_a, unit_b = self.units.get(a, 1), self.units.get(b, 1)
        b_loc = self.batch_size
        ranks = [self._rank_slice(r) for r in range(self.world_size)]
        held_a = [[h.whole.get(a, 0) for h in self.holdings[s]] for s in ranks]
        held_b = [[h.whole.get(b, 0) for h in self.holdings[s]] for s in ranks]
        rank_a, rank_b = [sum(x) for x in held_a], [sum(x) for x in held_b]
        hi = [min(b_loc, n) // unit_a * unit_a for n in rank_a]
        lo = [min(h, -(-max(0, b_loc - n) // unit_a) * unit_a) for h, n in zip(hi, rank_b, strict=True)]
        total_a = min(max(total_a, sum(lo)), sum(hi))
        xs = _even_split(total_a, lo, hi, unit_a, shift)
        if unit_a == 1:  # one image of a on a rank is a loader worker's part of one image: unfillable
            _no_single_images(xs, hi)
        quotas: list[Quota] = []
        for r, s in enumerate(ranks):
            y = min(b_loc - xs[r], rank_b[r])
            short = b_loc - xs[r] - y
            images = [h.images for h in self.holdings[s]]
            parts_a = apportion(xs[r], held_a[r], held_a[r], unit_a, shift)
            parts_b = apportion(y, held_b[r], held_b[r], unit_b, shift)
            parts_any = apportion(short, images, [short] * len(images), 1, shift)
            for na, nb, nany in zip(parts_a, parts_b, parts_any, strict=True):
                quota: Quota = [(a, na), (b, nb), (None, nany)]
                quotas.append([(c, n) for c, n in quota if n > 0])
        if len(self._quotas) > 4096:  # a step's quotas are computed once per worker: keep the cache small
            self._quotas.clear()
        self._quotas[(a, b, shift)] = quotas
        return quotas

    def _pair_total(self, a: int, b: int) -> int:
        """Images of category a in a global batch of pair (a, b): half, or all a has (b fills the rest),
        or more than half when b has less than half."""
        half = self.global_batch // 2
        total_a = min(half, self.totals.get(a, 0))
        if self.global_batch - total_a > self.totals.get(b, 0):
            total_a = self.global_batch - self.totals.get(b, 0)
        return total_a

    # ------------------------------------------------------------------ helpers
    def _rank_slice(self, rank: int) -> slice:
        return slice(rank * self.workers, (rank + 1) * self.workers)

    def _rank_images(self, consumer: int) -> int:
        return max(1, sum(h.images for h in self.holdings[self._rank_slice(consumer // self.workers)]))

    def _all_categories(self) -> list[int]:
        return sorted({c for h in self.holdings for c in h.whole})

    def _units(self) -> dict[int, int]:
        """Per category, the greatest common divisor of its class sizes (runs of 2+), so that quotas of
        whole classes of equal size add up exactly (e.g. when every class has 8 images)."""
        units: dict[int, int] = {}
        mapping = self.info.class_to_category
        for h in self.holdings:
            for cls, n in h.runs.items():
                if n >= 2:
                    c = mapping[cls] if cls < len(mapping) else -1
                    units[c] = math.gcd(units.get(c, 0), n)
        return units

    def _warn_categories(self, categories: list[int], why: str, exclude: bool = True) -> None:
        if not categories:
            return
        if exclude:
            self.excluded_categories = sorted({*self.excluded_categories, *categories})
        names = [self.info.category_names[c] for c in categories[:8]]
        verb = "are left out of" if exclude else "are in"
        warnings.warn(
            f"{len(categories)} categories have {why}, and {verb} {self.spec.name} sampling (e.g. {names}) "
            f"at train.global_batch_size={self.global_batch}",
            stacklevel=4,
        )

    def _warn_rank_imbalance(self, num_shards: int) -> None:
        per_rank = [sum(h.images for h in self.holdings[self._rank_slice(r)]) for r in range(self.world_size)]
        if max(per_rank) > 1.25 * max(1, min(per_rank)):
            warnings.warn(
                f"split {self.split!r}: ranks hold {min(per_rank)}..{max(per_rank)} images ({num_shards} "
                f"shards over {self.world_size} ranks); smaller ranks revisit their data more often. Prepare "
                f"with a smaller --shard-size for an even spread.",
                stacklevel=4,
            )


def check_batch(
    info: DatasetInfo,
    split: str,
    sampler: SamplerSpec | Any,
    global_batch: int,
    world_size: int,
    loader_workers: int,
    where: str | None = None,
) -> TrainPlan:
    """Refuse, from dataset.json alone and before any process starts, a global batch the data cannot
    fill with this sampler and layout (raises `BatchError`, one line naming the keys and numbers);
    returns the plan. Messages use the service's config keys (train.global_batch_size, sampler.*)."""
    spec = sampler if isinstance(sampler, SamplerSpec) else SamplerSpec.from_config(sampler)
    if global_batch % world_size:
        raise BatchError(
            f"train.global_batch_size={global_batch} must be divisible by scaling.num_workers={world_size}"
        )
    return TrainPlan(info, split, spec, global_batch // world_size, world_size, max(1, loader_workers), where)
