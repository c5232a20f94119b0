"""`dataset.json`: the metadata written next to the shards so workers plan batches without scanning data.

The file is validated with pydantic on read, so a hand-edited or truncated file fails with the field at
fault instead of producing a silently wrong sampling plan.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

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

    @model_validator(mode="after")
    def _consistent(self) -> DatasetInfo:
        """Totals and ids that disagree were trusted: a split's steps per epoch, batch plans and category
        lookups built on them, and a sample whose class no shard lists was never trained."""
        problems = inconsistencies(self)
        if problems:
            raise ValueError(first_few(problems, 3, sep="; "))
        return self

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


def inconsistencies(info: DatasetInfo) -> list[str]:
    """Where ``info``'s totals and ids disagree with each other, one phrase each."""
    out = []
    classes, categories = len(info.class_names), len(info.category_names)
    if len(info.class_to_category) != classes:
        out.append(f"class_to_category has {len(info.class_to_category)} entries for {classes} classes")
    if any(not -1 <= c < categories for c in info.class_to_category):
        out.append(f"class_to_category names a category outside -1..{categories - 1}")
    for name, split in info.splits.items():
        listed: set[int] = set()
        for shard in split.shards:
            where = f"split {name!r} shard {shard.name!r}"
            ids = [cls for cls, _ in shard.class_counts]
            listed.update(ids)
            if any(not 0 <= cls < classes for cls in ids):
                bad = next(cls for cls in ids if not 0 <= cls < classes)
                out.append(f"{where}: class_counts names class {bad}, outside 0..{classes - 1}")
            if (total := sum(n for _, n in shard.class_counts)) != shard.num_samples:
                out.append(f"{where}: class_counts add up to {total}, num_samples is {shard.num_samples}")
            cats = shard.category_counts
            if cats and (total := sum(n for _, n in cats)) != shard.num_samples:
                out.append(f"{where}: category_counts add up to {total}, num_samples is {shard.num_samples}")
            if any(not -1 <= c < categories for c, _ in cats):
                out.append(f"{where}: category_counts names a category outside -1..{categories - 1}")
        if (total := sum(s.num_samples for s in split.shards)) != split.num_samples:
            out.append(f"split {name!r}: its shards hold {total} samples, num_samples is {split.num_samples}")
        if len(listed) != split.num_classes:
            out.append(
                f"split {name!r}: its shards list {len(listed)} classes, num_classes is {split.num_classes}"
            )
    for evaluation in info.evaluations:
        for split in (evaluation.query, evaluation.gallery):
            if split is not None and split not in info.splits:
                out.append(f"evaluation {evaluation.name!r} reads split {split!r}, which is not listed")
    return out


def evaluation_problem(info: DatasetInfo, evaluation: Evaluation) -> str | None:
    """Why no query of ``evaluation`` can have a relevant item, or None: a training run found it at its
    first evaluation, on every worker, as an error that named no split (and retried it)."""

    def classes(split: str) -> Counter[int]:
        counts: Counter[int] = Counter()
        for shard in info.split(split).shards:  # a class's images may spread over several shards
            counts.update(dict(shard.class_counts))
        return counts

    query, gallery = evaluation.query, evaluation.gallery
    if gallery == query:  # every query would find itself first: Recall@1 1.0 whatever the model
        return (
            f"evaluation {evaluation.name!r} searches split {query!r} with its own images as the gallery; "
            "leave gallery out (null) for leave-one-out retrieval within a split"
        )
    for split in filter(None, (query, gallery)):
        if info.split(split).num_samples == 0:
            return f"evaluation {evaluation.name!r} reads split {split!r}, which has no images"
    if gallery is None:
        if all(n < 2 for n in classes(query).values()):
            return (
                f"evaluation {evaluation.name!r}: every class of split {query!r} has one image, so no query "
                "has another image of its class to find"
            )
    elif not classes(query).keys() & classes(gallery).keys():
        return (
            f"evaluation {evaluation.name!r}: no class of split {query!r} has an image in split {gallery!r}"
        )
    return None


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
    except ValidationError as exc:
        problems = [
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
            if e["loc"]
            else e["msg"].removeprefix("Value error, ")
            for e in exc.errors()
        ]
        raise ValueError(
            f"{url} is not a valid dmltrain dataset.json: {first_few(problems, 3, sep='; ')}"
        ) from None
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
