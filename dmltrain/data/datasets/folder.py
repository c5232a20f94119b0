"""`folder`: one sub-folder per class (ImageFolder layout), optionally under train/test split folders.

Identity-per-folder face sets fit as they are published: VGGFace2 is `train/n000002/0001_01.jpg`,
`test/n000001/...` beside list files and a `bb_landmark/` metadata folder, and becomes a train split of
8,631 identities and a test split of 500 (leave-one-out, Smooth-AP's VGGFace2 protocol reports its mAP).
"""

from __future__ import annotations

from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, split_classes
from dmltrain.data.errors import first_few
from dmltrain.data.metadata import Evaluation

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
# Folders an archive tool or notebook leaves beside the classes: never classes.
NOT_CLASSES = ("__MACOSX",)
SPLIT_NAMES = ("train", "test", "val", "query", "gallery")


def scan_folder(source: Path, test_fraction: float = 0.0, seed: int = 0) -> SourceDataset:
    """Classes are folder names; with train/test sub-folders those are the splits, else `test_fraction`
    of the classes (a seeded choice) are held out, since DML tests on classes unseen in training."""
    if not source.is_dir():
        raise SourceLayoutError(f"folder: {source} is not a directory")
    subdirs = sorted(p for p in source.iterdir() if p.is_dir())
    # Any case: Train/ and Test/ read as two classes merged every class of a split into one. Named so in
    # another case, a folder is a split when it holds class folders, else a class (Bus/, Car/, Train/).
    split_dirs = [
        p
        for p in subdirs
        if p.name in SPLIT_NAMES or (p.name.lower() in SPLIT_NAMES and _holds_class_folders(p))
    ]
    names = [p.name.lower() for p in split_dirs]
    twins = sorted({n for n in names if names.count(n) > 1})
    if twins:
        raise SourceLayoutError(
            f"folder: {source} has two folders for split {twins[0]!r} "
            f"({', '.join(p.name + '/' for p in split_dirs if p.name.lower() == twins[0])}): merge them"
        )
    # Published layouts keep metadata folders beside the split folders (VGGFace2's bb_landmark/): those
    # hold no images and are skipped with a note; a folder that does hold images makes the layout ambiguous.
    others = [p for p in subdirs if p not in split_dirs and not _ignored(p)]
    notes = []
    with_images = [p for p in others if _has_images(p)] if split_dirs else []
    if with_images:  # which is it? As classes, train/ would be one class holding every training image
        raise SourceLayoutError(
            f"folder: {source} has split folders ({', '.join(d.name + '/' for d in split_dirs)}) beside "
            f"folders with images ({', '.join(d.name + '/' for d in with_images[:5])}"
            f"{' ...' if len(with_images) > 5 else ''}): move those into a split folder or out of "
            f"{source}; classes named {'/'.join(SPLIT_NAMES)} need another name"
        )
    if split_dirs:
        if test_fraction > 0:
            raise SourceLayoutError(
                f"folder: {source} has split folders ({', '.join(d.name + '/' for d in split_dirs)}), which "
                f"are its splits; a test fraction ({test_fraction}) applies only to a folder of class folders"
            )
        items = []
        for d in split_dirs:
            found, found_notes = _class_items(d, d.name.lower(), source)
            items += found
            notes += found_notes
        splits = [s for s in SPLIT_NAMES if s in names]
        notes += [f"folder: {p.name}/ holds no images and is not a split: ignored" for p in others]
    else:
        items, notes = _class_items(source, "train", source)
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
        notes=notes,
        options={"test_fraction": test_fraction, "seed": seed},
    )


def _ignored(directory: Path) -> bool:
    """Hidden and archive folders (`.thumbnails/`, macOS's `__MACOSX/`) are never classes nor splits."""
    return directory.name.startswith(".") or directory.name in NOT_CLASSES


def _holds_class_folders(directory: Path) -> bool:
    return any(p.is_dir() and not _ignored(p) and _has_images(p) for p in directory.iterdir())


def _has_images(directory: Path) -> bool:
    return any(p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES for p in directory.rglob("*"))


def _class_items(directory: Path, split: str, root: Path) -> tuple[list[SourceItem], list[str]]:
    """The images of every class folder, and notes on what was not read: hidden and archive folders,
    files whose suffix is not an image's, class folders without images (nothing left out unsaid)."""
    items = []
    ignored_dirs, empty, others = [], [], []
    for class_dir in sorted(p for p in directory.iterdir() if p.is_dir()):
        rel_dir = class_dir.relative_to(root).as_posix()
        if _ignored(class_dir):
            ignored_dirs.append(rel_dir)
            continue
        found = 0
        for path in sorted(class_dir.rglob("*")):
            if not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            if path.suffix.lower() in IMAGE_SUFFIXES:
                items.append(SourceItem(split=split, class_name=class_dir.name, path=rel, file=path))
                found += 1
            elif not path.name.startswith("."):  # .DS_Store and the like are no one's images
                others.append(rel)
        if not found:
            empty.append(rel_dir)
    notes = [f"folder: {d}/ is a hidden or archive folder, not a class: ignored" for d in ignored_dirs]
    if empty:
        notes.append(
            f"folder: {len(empty)} class folder(s) hold no images and are not classes: {first_few(empty, 5)}"
        )
    if others:
        notes.append(
            f"folder: {len(others)} file(s) without an image suffix ({', '.join(sorted(IMAGE_SUFFIXES))}) "
            f"were not read: {first_few(others, 5)}"
        )
    return items, notes
