"""What a converter hands to the shard writer: a list of labelled source images plus protocol hints."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dmltrain.data.metadata import Evaluation


class SourceLayoutError(ValueError):
    """The source directory does not have the published layout; the message names the missing file."""


@dataclass
class SourceItem:
    """One image of the source: where it is (or its bytes, for generated data) and its labels."""

    split: str
    class_name: str
    path: str  # as recorded in the sample's json: relative to the source root
    file: Path | None = None
    data: bytes | None = None
    category: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class SourceDataset:
    """A converter's result; the writer turns it into shards and `dataset.json`."""

    name: str
    items: list[SourceItem]
    evaluations: list[Evaluation]
    split_order: list[str]
    recall_ks: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    sampling_hints: dict[str, float | int | str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)  # converter options, part of the fingerprint


def natural_key(text: str) -> tuple[Any, ...]:
    """Sort '2' before '10' so class ids follow the source's numbering."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text))


def require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        raise SourceLayoutError(f"{what}: expected file {path} is missing")
    return path


def find_file(source: Path, names: list[str], what: str) -> Path:
    """The first of `names` (relative paths) that exists under `source`, else a clear layout error."""
    for name in names:
        if (source / name).is_file():
            return source / name
    raise SourceLayoutError(f"{what}: none of {names} found under {source}")


def split_classes(class_names: list[str], test_fraction: float, seed: int) -> set[str]:
    """Held-out test classes, chosen by a seeded permutation so the split is reproducible."""
    import numpy as np

    if not 0.0 <= test_fraction < 1.0:
        raise ValueError(f"test fraction must be in [0, 1), got {test_fraction}")
    ordered = sorted(set(class_names), key=natural_key)
    count = round(len(ordered) * test_fraction)
    if test_fraction > 0 and len(ordered) >= 2:
        count = min(max(count, 1), len(ordered) - 1)
    order = np.random.default_rng(seed).permutation(len(ordered))
    return {ordered[i] for i in order[:count]}
