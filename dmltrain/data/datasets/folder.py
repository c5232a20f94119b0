"""`folder`: one sub-folder per class (ImageFolder layout), optionally under train/test split folders."""

from __future__ import annotations

from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, split_classes
from dmltrain.data.metadata import Evaluation

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
SPLIT_NAMES = ("train", "test", "val", "query", "gallery")


def scan_folder(source: Path, test_fraction: float = 0.0, seed: int = 0) -> SourceDataset:
    """Classes are folder names; with train/test sub-folders those are the splits, else `test_fraction`
    of the classes (a seeded choice) are held out, since DML tests on classes unseen in training."""
    if not source.is_dir():
        raise SourceLayoutError(f"folder: {source} is not a directory")
    subdirs = sorted(p for p in source.iterdir() if p.is_dir())
    if subdirs and all(p.name in SPLIT_NAMES for p in subdirs):
        items = [it for d in subdirs for it in _class_items(d, d.name, source)]
        splits = [s for s in SPLIT_NAMES if any(d.name == s for d in subdirs)]
    else:
        items = _class_items(source, "train", source)
        held_out = split_classes([it.class_name for it in items], test_fraction, seed)
        for it in items:
            if it.class_name in held_out:
                it.split = "test"
        splits = ["train", "test"] if held_out else ["train"]
    if not items:
        raise SourceLayoutError(f"folder: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {source}")
    evaluations = []
    if "query" in splits and "gallery" in splits:
        evaluations.append(Evaluation(name="test", query="query", gallery="gallery"))
    for split in ("test", "val"):
        if split in splits:
            evaluations.append(Evaluation(name=split, query=split))
    return SourceDataset(
        name=source.name,
        items=items,
        evaluations=evaluations,
        split_order=splits,
        options={"test_fraction": test_fraction, "seed": seed},
    )


def _class_items(directory: Path, split: str, root: Path) -> list[SourceItem]:
    items = []
    for class_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
        for path in sorted(class_dir.rglob("*")):
            if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
                rel = path.relative_to(root).as_posix()
                items.append(SourceItem(split=split, class_name=class_dir.name, path=rel, file=path))
    return items
