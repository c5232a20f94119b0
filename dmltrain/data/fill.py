"""Filling a batch part of exactly n images from whole items (a class's group, or a K-piece of it), at most
one item per class.

Samplers offer items in a random order and take each one that still fits; what that greedy pass leaves
unfilled is repaired by a small subset-sum over the items not taken, optionally giving one taken item
back. So whole classes fill a part exactly whenever an exchange of a few items can, and a class is cut
only when none can (the caller counts that).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

Item = tuple[Any, int, int]  # (handle, class, images)


@dataclass
class Fill:
    """A part being filled: images still missing, classes already in it, items taken (in order)."""

    need: int
    used: set[int] = field(default_factory=set)
    taken: list[Item] = field(default_factory=list)

    def take(self, item: Item) -> None:
        self.taken.append(item)
        self.used.add(item[1])
        self.need -= item[2]

    def give_back(self, index: int) -> Item:
        item = self.taken.pop(index)
        self.used.discard(item[1])
        self.need += item[2]
        return item


def take_greedy(items: Iterable[Item], fill: Fill, limit: int) -> int:
    """Take items in order while they fit into `limit` images (this category's share) and do not leave
    exactly one image of the part to fill (one image of a class would have no positive); returns the
    images taken."""
    got = 0
    for item in items:
        if fill.need == 0 or got == limit:
            break
        _, cls, size = item
        if cls in fill.used or size > limit - got or size > fill.need or fill.need - size == 1:
            continue
        fill.take(item)
        got += size
    return got


def repair(fill: Fill, free: Iterable[Item], max_target: int = 64) -> bool:
    """Complete `fill` exactly from `free` items (classes not in the part): add a subset summing to the
    missing images, or give one taken item back and add a subset summing to the missing images plus its
    size. Targets above `max_target` are not searched (a part that short lacks classes, not an exchange)."""
    if fill.need == 0:
        return True
    candidates: list[Item] = []
    seen: set[int] = set()
    for item in free:
        if item[1] not in fill.used and item[1] not in seen and item[2] > 0:
            seen.add(item[1])
            candidates.append(item)
    tried: set[int] = set()
    for drop in [None, *range(len(fill.taken) - 1, -1, -1)]:
        extra = 0
        if drop is not None:
            extra = fill.taken[drop][2]
            if extra in tried:
                continue
            tried.add(extra)
        target = fill.need + extra
        if target > max_target:
            continue
        pool = [c for c in candidates if drop is None or c[1] != fill.taken[drop][1]]
        chosen = subset_sum([c[2] for c in pool], target)
        if chosen is None:
            continue
        if drop is not None:
            fill.give_back(drop)
        for i in chosen:
            fill.take(pool[i])
        return True
    return False


def subset_sum(sizes: list[int], target: int) -> list[int] | None:
    """Indices of `sizes` (earliest first) adding up to `target`, or None. Only `target // s` items of each
    size can matter, so the search costs O(target^2 log target) whatever the number of items."""
    if target == 0:
        return []
    kept: list[int] = []
    per_size: dict[int, int] = {}
    for i, s in enumerate(sizes):
        if 0 < s <= target and per_size.get(s, 0) < target // s:
            per_size[s] = per_size.get(s, 0) + 1
            kept.append(i)
    back: dict[int, tuple[int, int]] = {0: (-1, -1)}  # reachable sum -> (previous sum, item)
    for i in kept:
        s = sizes[i]
        for reached in list(back):  # a snapshot: each item is used at most once
            total = reached + s
            if total <= target and total not in back:
                back[total] = (reached, i)
                if total == target:
                    out = []
                    while total:
                        total, item = back[total]
                        out.append(item)
                    return sorted(out)
    return None
