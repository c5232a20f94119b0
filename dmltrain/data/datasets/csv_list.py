"""`csv`: a list file with columns path, class and optionally category and split (header required)."""

from __future__ import annotations

import csv
from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, split_classes
from dmltrain.data.metadata import Evaluation


def scan_csv(
    source: Path, image_root: Path | None = None, test_fraction: float = 0.0, seed: int = 0
) -> SourceDataset:
    """Paths are relative to `image_root` (default: the CSV's folder); without a split column,
    `test_fraction` of the classes are held out for testing."""
    if not source.is_file():
        raise SourceLayoutError(f"csv: {source} is not a file")
    try:
        return _scan(source, image_root or source.parent, test_fraction, seed)
    except UnicodeDecodeError as exc:
        raise SourceLayoutError(f"csv: {source} is not UTF-8 text ({exc}); save it as UTF-8") from None


def _scan(source: Path, root: Path, test_fraction: float, seed: int) -> SourceDataset:
    items = []
    with source.open(newline="", encoding="utf-8-sig") as handle:  # a spreadsheet's BOM is not the header
        reader = csv.DictReader(handle)
        fields = {f.strip().lower(): f for f in reader.fieldnames or []}
        missing = {"path", "class"} - set(fields)
        if missing:
            raise SourceLayoutError(
                f"csv: {source} lacks column(s) {sorted(missing)}; header: {reader.fieldnames}"
            )
        for line, row in enumerate(reader, start=2):
            path = (row[fields["path"]] or "").strip()
            cls = (row[fields["class"]] or "").strip()
            if not path or not cls:
                raise SourceLayoutError(f"csv: {source}:{line}: empty path or class")
            category = (row[fields["category"]] or "").strip() or None if "category" in fields else None
            split = (row[fields["split"]] or "").strip().lower() or "train" if "split" in fields else "train"
            items.append(SourceItem(split, cls, path, file=root / path, category=category))
    if not items:
        raise SourceLayoutError(f"csv: {source} has no rows")
    if "split" in fields and test_fraction > 0:
        raise SourceLayoutError(
            f"csv: {source} has a split column, which gives the splits; a test fraction ({test_fraction}) "
            "applies only to a list without one"
        )
    if "split" not in fields:
        held_out = split_classes([it.class_name for it in items], test_fraction, seed)
        for it in items:
            if it.class_name in held_out:
                it.split = "test"
    order = ["train", "test", "val", "query", "gallery"]
    splits = [s for s in order if any(it.split == s for it in items)]
    splits += sorted({it.split for it in items} - set(splits))
    evaluations = []
    if "query" in splits and "gallery" in splits:
        evaluations.append(Evaluation(name="test", query="query", gallery="gallery"))
    evaluations += [Evaluation(name=s, query=s) for s in splits if s not in ("train", "query", "gallery")]
    return SourceDataset(
        name=source.stem,
        items=items,
        evaluations=evaluations,
        split_order=splits,
        options={"image_root": str(root), "test_fraction": test_fraction, "seed": seed},
    )
