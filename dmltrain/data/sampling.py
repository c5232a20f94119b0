"""Batchers: class-level sampling over an endless group stream with bounded buffers of encoded images.

Each loader worker fills its *part* of every local batch from the classes its own shards hold, and the
loader's main process joins the parts of a step (`plan.py` says how a batch is split into parts).
- `pk`: P classes x K images (Smooth-AP |P| = 4; RLL C-way K-shot), a pass over the data per epoch.
- `random`: whole classes at random until the part is full (FastAP's "random" baseline).
- `hard`: FastAP's category pairs - half the global batch from category a, half from b, where (a, b) is a
  pure function of (seed, global step), so every rank draws the same pair in the same step without
  talking. A sampled class enters the batch whole (FastAP supplement A).
- `vehicleid`: half from one labelled category, half from unlabelled classes (FastAP supplement A).
- `triplet`: Deep Ranking online sampling with per-category reservoirs (keys u^(1/r)).

Buffers hold encoded bytes, so memory is bounded by the pool (`pool_images`, or the classes one part
needs when that is more; `pk`/`random` hold at most about twice that) x the encoded image size. A
batcher's `state_dict` names buffered samples by (shard, member), small enough to travel with every part.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np

from dmltrain.data.errors import SamplingError
from dmltrain.data.fill import Fill, Item, repair, take_greedy
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


def split_group(
    samples: list[Sample], k: int | None, counters: Counter[str], rng: np.random.Generator | None = None
) -> list[list[Sample]]:
    """Cut a class group into parts of K (smaller classes whole); no part of one image, which has no positive.

    A remainder of one borrows from the last full part (K-1 + 2) when K >= 3. With K = 2 one image waits
    for the next pass (counted as skipped): one drawn from ``rng``, so that over the passes every image is
    trained (without it, the last one, which was the same image on every pass and never trained).
    """
    n = len(samples)
    if n < 2:
        counters["skipped_single_images"] += n
        return []
    if k is None or n <= k:
        return [samples]
    if k < 3 and n % k == 1 and rng is not None:
        left_out = int(rng.integers(n))
        samples = samples[:left_out] + samples[left_out + 1 :] + samples[left_out : left_out + 1]
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


def largest_piece(n: int, k: int | None) -> int:
    """The largest part `split_group` cuts from a class group of n images: what one batch can take of it."""
    if n < 2:
        return 0
    if k is None or n <= k:
        return n
    return k - 1 if n == k + 1 and k >= 3 else k


def on_turn(step: int, position: int, holders: int, offset: int) -> bool:
    """Whether the holder at `position` of a class that `holders` consumers hold offers it in global step
    `step`: each step exactly one of them, every process agreeing without talking. `offset` staggers the
    classes of the same holders, so that they share each step's turns evenly (`TrainPlan.turns`)."""
    return (step + offset) % holders == position


def _refs(samples: list[Sample]) -> list[list[int]]:
    return [[s.shard, s.member] for s in samples]


def _lookup(refs: list[list[int]], found: dict[tuple[int, int], Sample]) -> list[Sample]:
    return [found[(int(a), int(b))] for a, b in refs]


class Batcher:
    """Common plumbing: the stream, this worker's part size, a seeded generator and counters of what was
    dropped, cut or repeated. `where` names the worker in messages."""

    def __init__(self, stream: GroupStream, part: int, spec: SamplerSpec, seed: int, where: str) -> None:
        self.stream = stream
        self.batch_size = part
        self.spec = spec
        self.where = where
        self.rng = np.random.default_rng(seed)
        self.counters: Counter[str] = Counter()
        self.pool_images = spec.pool_images or max(8 * part, 1024)

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
    """`pk` (pieces of at most K) and `random` (whole classes): a part of distinct classes from a pool.

    The pool is filled to `pool_images`, and further (at most one more pass over this worker's shards)
    until it holds twice the classes a part needs, so a part that its shards can fill always finds them;
    past twice its size it takes only classes it lacks. A `pk` class group is shuffled before it is cut
    into pieces, so a class meets its other images in new pieces on every pass.
    """

    def __init__(
        self,
        stream: GroupStream,
        part: int,
        spec: SamplerSpec,
        seed: int,
        where: str,
        held_classes: int,
        held_images: int,
        capacity: int,
        turns: dict[int, tuple[int, int, int]] | None = None,
    ) -> None:
        super().__init__(stream, part, spec, seed, where)
        self.k = spec.samples_per_class if spec.name == "pk" else None
        self.turns = turns or {}  # class -> (position, holders, offset) of classes others hold too
        self.pool: list[list[Sample]] = []
        self.size = 0
        self.pool_classes: Counter[int] = Counter()  # pieces of each class in the pool
        self.held_classes = held_classes  # classes of 2+ images in this worker's shards
        self.capacity = capacity  # images one piece per class of those classes can give a part
        self.pass_images = max(1, held_images)
        mean_piece = min(self.k or math.inf, held_images / max(1, held_classes))
        self.want_classes = min(held_classes, 2 * math.ceil(part / max(2.0, mean_piece)))
        # Past this the pool takes only classes it lacks (see _ingest): twice what the pool or the classes
        # it wants hold, so that balanced data never reaches it.
        self.most_images = 2 * max(self.pool_images, math.ceil(self.want_classes * max(2.0, mean_piece)))
        self.steps_per_pass = max(2, math.ceil(self.pass_images / max(1, part)))

    def _ingest(self, group: Group, *, short: bool = False) -> int:
        samples = group.samples
        if short:
            # A part came up short and a pass is read for pieces that add up: more pieces of a class than a
            # pass of steps can take (one a step), none larger than it has, only piled up (391,000 images
            # held for 5,181).
            surplus = self.pool_classes[group.cls] >= self.steps_per_pass and self._has_piece_as_large(group)
        else:
            # Read past a full pool for the classes it lacks, more pieces of a class it has piled up (a part
            # takes one piece per class) without bound on data where one class is common (a class of 3,000
            # among 20 of 4: 290,000 images held at step 2,000).
            surplus = self.size >= self.most_images and group.cls in self.pool_classes
        if surplus:  # its images come round again next pass
            self.counters["pool_overflow_images"] += len(samples)
            return len(samples)
        if self.k is not None and len(samples) > self.k:
            # A shard stores a group in one order: cut as stored, a class gave the same K-pieces on every
            # pass (a 5-image class always 3 + 2; most positive pairs of a large class never met).
            samples = [samples[i] for i in self.rng.permutation(len(samples))]
        for piece in split_group(samples, self.k, self.counters, self.rng):
            self.pool.append(piece)
            self.size += len(piece)
            self.pool_classes[piece[0].cls] += 1
        return len(group.samples)

    def _has_piece_as_large(self, group: Group) -> bool:
        """Whether the pool holds a piece of the group's class as large as the largest the group gives."""
        largest = largest_piece(len(group.samples), self.k)
        return any(len(piece) >= largest for piece in self.pool if piece[0].cls == group.cls)

    def _fill(self) -> None:
        read = 0
        while self.size < self.pool_images or (
            len(self.pool_classes) < self.want_classes and read < self.pass_images
        ):
            read += self._ingest(self.stream.next_group())
            if self.size == 0 and read >= self.pass_images:
                raise SamplingError(f"{self.where}: its shards hold no class with 2 or more images")

    def next_batch(self, step: int) -> list[Sample]:
        if self.batch_size == 0:
            return []
        self._fill()
        for _ in range(2):
            chosen = self._select(step)
            if chosen is not None:
                return chosen
            read = 0  # what the part lacks may be further on: read one more pass, then give up
            while read < self.pass_images:
                read += self._ingest(self.stream.next_group(), short=True)
        raise SamplingError(self._shortage())

    def _select(self, step: int) -> list[Sample] | None:
        """One piece per class, in a random order over the pool's pieces (so a class is drawn as often as
        it has pieces: a pass over the data per epoch); None, with the pool untouched, when short.

        A part the first pieces cannot fill is tried again with each class's largest piece: the batch plan
        counts those (a class of K+1 cut into K-1 + 2 gives K-1), so a part it accepts is not refused
        because the smaller pieces came first. A class other consumers hold too is offered only on this
        consumer's turn (`on_turn`); a part that cannot be filled without the others' takes them as a last
        resort, counted as `off_turn_classes` (each may then be in the global batch twice)."""
        order = self.rng.permutation(len(self.pool))
        blocked = {
            cls for cls in self.pool_classes if cls in self.turns and not on_turn(step, *self.turns[cls])
        }
        for allowed in (blocked, set()) if blocked else (blocked,):
            for pieces in (_first_piece_per_class, _largest_piece_per_class):
                picked = self._pick(pieces, order, allowed, last=blocked - allowed)
                if picked is not None:
                    fill, cut = picked
                    if not allowed and blocked:
                        cut_class = {self.pool[cut[0]][0].cls} if cut is not None else set()
                        self.counters["off_turn_classes"] += len((fill.used | cut_class) & blocked)
                    return self._take(fill, cut)
        return None

    def _pick(
        self,
        pieces: Callable[[list[list[Sample]], np.ndarray], Iterator[Item]],
        order: np.ndarray,
        blocked: set[int],
        last: set[int],
    ) -> tuple[Fill, tuple[int, int] | None] | None:
        """The pieces (and the one cut to fit) that fill the part, offered by ``pieces`` in ``order``,
        leaving out the classes in ``blocked`` and offering those in ``last`` after all others (another
        consumer's turn: only what the part cannot do without)."""

        def offer() -> Iterator[Item]:  # lazy: a full part rarely scans the whole pool
            first = (it for it in pieces(self.pool, order) if it[1] not in blocked and it[1] not in last)
            return itertools.chain(first, (it for it in pieces(self.pool, order) if it[1] in last))

        items = offer()
        fill = Fill(self.batch_size)
        cut: tuple[int, int] | None = None  # (pool index, images taken) of a piece cut to fit
        if self.k is not None:  # pk: the piece that overflows is cut (pieces are cuts of a class anyway)
            for item in items:
                i, cls, size = item
                if cls in fill.used:
                    continue
                if size <= fill.need and fill.need - size != 1:
                    fill.take(item)
                elif size > fill.need >= 2:
                    cut, fill.need = (i, fill.need), 0
                if fill.need == 0:
                    break
        else:
            take_greedy(items, fill, fill.need)
        if fill.need:  # short: every class of the pool is a candidate for an exchange or a cut
            items = offer()
        if fill.need and not repair(fill, items) and fill.need >= 2:
            items = offer()
            big = next((it for it in items if it[1] not in fill.used and it[2] > fill.need), None)
            if big is not None:  # whole classes cannot add up: cut one, counted
                cut, fill.need = (big[0], fill.need), 0
                self.counters["cut_classes"] += 1
        if fill.need:
            return None
        return fill, cut

    def _take(self, fill: Fill, cut: tuple[int, int] | None) -> list[Sample]:
        """Remove the chosen pieces (and the cut piece's taken images) from the pool; their images."""
        removed = {i for i, _, _ in fill.taken}
        chosen = [s for i, _, _ in fill.taken for s in self.pool[i]]
        if cut is not None:
            i, n = cut
            chosen += self.pool[i][:n]
            rest = self.pool[i][n:]
            if len(rest) < 2:
                self.counters["dropped_remainder_images"] += len(rest)
                removed.add(i)
            else:
                self.pool[i] = rest
        for i in removed:
            cls = self.pool[i][0].cls
            self.pool_classes[cls] -= 1
            if not self.pool_classes[cls]:
                del self.pool_classes[cls]
        self.pool = [p for j, p in enumerate(self.pool) if j not in removed]
        self.size = sum(len(p) for p in self.pool)
        return chosen

    def _shortage(self) -> str:
        piece = f"piece of at most sampler.samples_per_class={self.k}" if self.k else "whole class"
        head = (
            f"{self.where} could not fill its part of {self.batch_size} images from distinct classes: its "
            f"pool of {self.size} images holds {len(self.pool_classes)} classes; its shards hold "
            f"{self.held_classes} classes of 2+ images, at most {self.capacity} images one {piece} each. "
        )
        if self.capacity < self.batch_size:
            return (
                head
                + "The data cannot fill this part and the batch plan should have refused it: please report"
            )
        if len(self.pool_classes) >= self.held_classes:  # a larger pool holds no other class
            return head + (
                "The pool holds every one of them, but the pieces left this pass do not add up to the part: "
                "lower train.global_batch_size or sampler.samples_per_class"
            )
        return (
            head + f"Raise sampler.pool_images (now {self.pool_images}) so that more classes are held at once"
        )

    def buffered_refs(self) -> list[list[int]]:
        return [r for part in self.pool for r in _refs(part)]

    def _buffers_state(self) -> dict[str, Any]:
        return {"part_sizes": [len(p) for p in self.pool]}

    def _load_buffers(self, state: dict[str, Any], samples: list[Sample]) -> None:
        flat = iter(samples)
        self.pool = [[next(flat) for _ in range(n)] for n in state["part_sizes"]]
        self.size = sum(state["part_sizes"])
        self.pool_classes = Counter(p[0].cls for p in self.pool)


def _largest_piece_per_class(pool: list[list[Sample]], order: np.ndarray) -> Iterator[Item]:
    """(pool index, class, images) of each class's largest piece (the first in `order` among equals), in
    the order of the classes' first pieces."""
    best: dict[int, tuple[int, int]] = {}
    for i in order:
        cls, size = pool[i][0].cls, len(pool[i])
        if cls not in best or size > best[cls][1]:
            best[cls] = (int(i), size)
    for cls, (i, size) in best.items():
        yield i, cls, size


def _first_piece_per_class(pool: list[list[Sample]], order: np.ndarray) -> Iterator[Item]:
    """(pool index, class, images) of each class's first piece in `order`."""
    seen: set[int] = set()
    for i in order:
        cls = pool[i][0].cls
        if cls not in seen:
            seen.add(cls)
            yield int(i), cls, len(pool[i])


Quota = list[tuple[int | None, int]]  # (category, images) of one part; None = any category


class ReservoirBatcher(Batcher):
    """`hard` and `vehicleid`: per-category buffers of whole class groups, filled from the stream and served
    by the quota the plan gives this worker in each step ((category, images) pairs).

    Each step reads as many new images as its part (so an epoch of steps reads about an epoch of data),
    then fills the quota with whole classes: unserved groups first; served ones stay as a fallback for
    categories this worker holds little of, and are evicted first when a buffer is full. Whole classes
    that cannot add up to a category's share exactly leave the rest to the other category; a class is
    cut only when no exchange of classes fills the part (counted as `cut_classes`).
    """

    def __init__(
        self,
        stream: GroupStream,
        spec: SamplerSpec,
        seed: int,
        where: str,
        quota: Callable[[int], Quota],
        local_counts: dict[int, int],
        largest_quota: dict[int, int],
        part: int,
    ) -> None:
        super().__init__(stream, part, spec, seed, where)
        self.quota = quota
        total = max(1, sum(local_counts.values()))
        served = {c: n for c, n in local_counts.items() if c in largest_quota}
        self.capacity = {
            c: max(largest_quota[c], math.ceil(self.pool_images * n / total)) for c, n in served.items()
        }
        # Reading ahead cannot find more of c than this worker holds: stop once all of it is buffered.
        self.reachable = {c: min(self.capacity[c], n) for c, n in served.items()}
        self.pass_images = total  # reading this far ahead has seen every image this worker holds
        self.fresh: dict[int, list[list[Sample]]] = {c: [] for c in served}
        self.used: dict[int, deque[list[Sample]]] = {c: deque() for c in served}
        self.size: Counter[int] = Counter()

    def _ingest(self, group: Group) -> int:
        c = group.category
        if c not in self.fresh:  # a category that is never scheduled (e.g. too small for any batch)
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
        quota = [(c, n) for c, n in self.quota(step) if n > 0]
        part = sum(n for _, n in quota)
        if part == 0:
            return []
        read = 0
        # Empty buffers (the first step) are primed with a pool's worth; later steps read one part.
        target = part if sum(self.size.values()) else max(part, min(self.pool_images, self.pass_images))
        while read < target:
            read += self._ingest(self.stream.next_group())
        for c, n in quota:
            if c is not None:
                self._read_ahead(c, n)
        fill = Fill(part)
        for c, n in quota:  # each category's share, as exactly as its whole classes allow
            share = Fill(n, fill.used)
            take_greedy(self._items(c), share, n)
            repair(share, self._items(c))
            fill.taken += share.taken
            fill.need -= n - share.need
        planned = [c for c, _ in quota]
        repair(fill, self._items(*planned))  # the planned categories, past their shares where needed
        chosen: list[Sample] = [s for (_, group), _, _ in fill.taken for s in group]
        for categories in (planned, [None]):
            if fill.need >= 2:  # no exchange of whole classes fills the part: cut a larger class (counted)
                items = self._items(*categories)
                big = next((it for it in items if it[1] not in fill.used and it[2] > fill.need), None)
                if big is not None:
                    chosen += big[0][1][: fill.need]
                    fill.need = 0
                    self.counters["cut_classes"] += 1
            for handle, cls, size in self._items(*categories):  # what still fits whole
                if fill.need and cls not in fill.used and size <= fill.need:
                    fill.take((handle, cls, size))
                    chosen += handle[1]
        self.counters["off_plan_images"] += sum(size for (c, _), _, size in fill.taken if c not in planned)
        if not chosen:
            raise SamplingError(f"{self.where}: no class of 2+ images of categories {planned} is buffered")
        while len(chosen) < part:  # the part must have its size: repeat images (counted)
            self.counters["repeated_images"] += 1
            chosen.append(chosen[int(self.rng.integers(len(chosen)))])
        self._mark_served([handle for handle, _, _ in fill.taken])
        return chosen

    def _read_ahead(self, c: int, need: int) -> None:
        if c not in self.fresh:
            return
        read = 0
        while (
            sum(len(g) for g in self.fresh[c]) < need
            and self.size[c] < self.reachable[c]
            and read < self.pass_images
        ):
            read += self._ingest(self.stream.next_group())

    def _items(self, *categories: int | None) -> Iterator[Item]:
        """Groups of `categories` (None: every category) as fill items: unserved ones in a random order,
        then served ones in a random order."""
        cats = sorted(self.fresh) if None in categories else [c for c in categories if c in self.fresh]
        for source in (self.fresh, self.used):
            groups = [(c, g) for c in cats for g in source[c]]
            for i in self.rng.permutation(len(groups)):
                c, g = groups[i]
                yield (c, g), g[0].cls, len(g)

    def _mark_served(self, handles: list[tuple[int, list[Sample]]]) -> None:
        for c in {c for c, _ in handles}:
            ids = {id(g) for cat, g in handles if cat == c}
            moved = [g for g in self.fresh[c] if id(g) in ids]
            self.fresh[c] = [g for g in self.fresh[c] if id(g) not in ids]
            self.used[c].extend(moved)

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
        where: str,
        local_share: dict[int, float],
    ) -> None:
        super().__init__(stream, batch_size, spec, seed, where)
        if batch_size % 3:
            raise ValueError(
                f"triplet batches hold whole triplets: part size {batch_size} is not a multiple of 3"
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
            # by shard position, not identity: a resumed buffer holds one object per image, and a stream
            # that wrapped around may have put a second copy of the query in (never its own positive)
            where = (query.shard, query.member)
            positives = [s for s in buf if s.cls == query.cls and (s.shard, s.member) != where]
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
        out: list[Sample] = []  # a part of 0 images (a worker with no share of this batch) reads nothing
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
