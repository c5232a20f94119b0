"""CUB-200-2011: images.txt, image_class_labels.txt, classes.txt, images/; classes 1-100 train,
101-200 test (the DML convention, not the official per-image split)."""

from __future__ import annotations

from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, find_file
from dmltrain.data.metadata import Evaluation


def _pairs(path: Path) -> dict[str, str]:
    out = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            parts = line.split(maxsplit=1)
            if len(parts) != 2:
                raise SourceLayoutError(f"cub: {path}:{number}: expected '<id> <value>', got {line!r}")
            out[parts[0]] = parts[1].strip()
    return out


def scan_cub(source: Path) -> SourceDataset:
    images_file = find_file(source, ["images.txt", "CUB_200_2011/images.txt"], "cub")
    root = images_file.parent
    images = _pairs(images_file)
    labels = _pairs(find_file(root, ["image_class_labels.txt"], "cub"))
    class_names = _pairs(find_file(root, ["classes.txt"], "cub"))
    num_classes = len(class_names)
    items = []
    for image_id, rel in images.items():
        if image_id not in labels:
            raise SourceLayoutError(f"cub: image {image_id} ({rel}) has no line in image_class_labels.txt")
        class_id = int(labels[image_id])
        split = "train" if class_id <= num_classes // 2 else "test"
        items.append(
            SourceItem(
                split,
                class_names.get(str(class_id), str(class_id)),
                f"images/{rel}",
                file=root / "images" / rel,
                meta={"image_id": int(image_id), "class_id": class_id},
            )
        )
    return SourceDataset(
        name="cub",
        items=items,
        evaluations=[Evaluation(name="test", query="test")],
        split_order=["train", "test"],
    )
