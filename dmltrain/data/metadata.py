"""`dataset.json`: the metadata written next to the shards so workers plan batches without scanning data.

The file is validated with pydantic on read, so a hand-edited or truncated file fails with the field at
fault instead of producing a silently wrong sampling plan.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from dmltrain.data.errors import first_few
from dmltrain.data.urls import join_url, read_bytes

FORMAT_VERSION = 1
METADATA_NAME = "dataset.json"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ShardInfo(_Model):
    """One tar file: its name (relative to the dataset root) and what is inside, for planning."""

    name: str
    num_samples: int
    class_counts: list[tuple[int, int]] = Field(description="(class id, images) pairs in this shard.")
    category_counts: list[tuple[int, int]] = Field(
        default_factory=list, description="(category id, images) pairs; -1 = no category label."
    )
    size_bytes: int | None = Field(
        default=None, description="Bytes of the tar file as written (None: prepared before sizes were kept)."
    )


class SkippedFile(_Model):
    """A source image that was not written, and why (never dropped silently)."""

    path: str
    split: str
    reason: str


class SplitInfo(_Model):
    num_samples: int
    num_classes: int
    num_categories: int
    shards: list[ShardInfo]
    singleton_classes: list[int] = Field(
        default_factory=list, description="Classes with exactly one image here: no positive for a query."
    )
    empty_classes: list[int] = Field(
        default_factory=list, description="Classes listed by the source whose every image was skipped."
    )


class Evaluation(_Model):
    """One retrieval test: queries from `query`; gallery split, or None for leave-one-out in `query`."""

    name: str
    query: str
    gallery: str | None = None


class DatasetInfo(_Model):
    format_version: int = FORMAT_VERSION
    name: str
    source_format: str
    source: str
    fingerprint: str
    splits: dict[str, SplitInfo]
    class_names: list[str] = Field(description="Original class id/name for each class id.")
    class_to_category: list[int] = Field(description="Category id of each class id; -1 = unlabelled.")
    category_names: list[str]
    evaluations: list[Evaluation]
    recall_ks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8])
    sampling_hints: dict[str, float | int | str] = Field(default_factory=dict)
    skipped: list[SkippedFile] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def num_categories(self) -> int:
        return len(self.category_names)

    def split(self, name: str) -> SplitInfo:
        """The split's metadata, or an error that lists the splits this data set has."""
        if name not in self.splits:
            raise KeyError(f"dataset {self.name!r} has no split {name!r}; splits: {sorted(self.splits)}")
        return self.splits[name]

    @property
    def evaluated_splits(self) -> list[str]:
        """Every split an evaluation reads (queries and galleries), sorted."""
        return sorted({s for e in self.evaluations for s in (e.query, e.gallery) if s is not None})

    def shard_urls(self, root: str | Path, split: str) -> list[str]:
        return [join_url(str(root), s.name) for s in self.split(split).shards]


def load_dataset_info(root: str | Path) -> DatasetInfo:
    """Read and validate `<root>/dataset.json` (local directory or URL)."""
    url = join_url(str(root), METADATA_NAME)
    try:
        raw = read_bytes(url)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{url} not found: prepare the data first (`dmltrain prepare <format> <source> {root}`)"
        ) from exc
    try:
        info = DatasetInfo.model_validate(json.loads(raw))
    except ValueError as exc:
        raise ValueError(f"{url} is not a valid dmltrain dataset.json: {exc}") from exc
    if info.format_version != FORMAT_VERSION:
        raise ValueError(f"{url}: format_version {info.format_version}, this dmltrain reads {FORMAT_VERSION}")
    return info


def damaged_shards(info: DatasetInfo, root: str | Path, splits: list[str] | None = None) -> str | None:
    """What is wrong with the shards ``info`` lists under the local directory ``root`` (all splits, or
    ``splits``), as one phrase (each shard missing or not at the size it was written with; the first three,
    then a count), or None when every shard is intact."""
    base = Path(root)
    names = list(info.splits) if splits is None else [s for s in dict.fromkeys(splits) if s in info.splits]
    damaged = []
    for name in names:
        for shard in info.splits[name].shards:
            path = base / shard.name
            if not path.is_file():
                damaged.append(f"shard {shard.name} is missing")
            elif shard.size_bytes is not None and (size := path.stat().st_size) != shard.size_bytes:
                damaged.append(f"shard {shard.name} has {size} bytes, {shard.size_bytes} written")
    if not damaged:
        return None
    return first_few(damaged, 3, sep="; ")
