"""Stanford Online Products: Ebay_train.txt / Ebay_test.txt (image_id class_id super_class_id path).

Categories are the 12 super-classes (bicycle, cabinet, ...), named after the image folders
(`bicycle_final/...`); FastAP samples 5 batches per category pair (supplement A)."""

from __future__ import annotations

from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, find_file
from dmltrain.data.metadata import Evaluation


def scan_sop(source: Path) -> SourceDataset:
    items = []
    for split, name in (("train", "Ebay_train.txt"), ("test", "Ebay_test.txt")):
        list_file = find_file(source, [name, f"Stanford_Online_Products/{name}"], "sop")
        root = list_file.parent
        lines = list_file.read_text().splitlines()
        if not lines or lines[0].split()[:2] != ["image_id", "class_id"]:
            raise SourceLayoutError(
                f"sop: {list_file} should start with 'image_id class_id super_class_id path'"
            )
        for number, line in enumerate(lines[1:], start=2):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 4:
                raise SourceLayoutError(f"sop: {list_file}:{number}: expected 4 fields, got {line!r}")
            image_id, class_id, super_id, path = parts
            category = path.split("/")[0].removesuffix("_final")
            items.append(
                SourceItem(
                    split,
                    class_id,
                    path,
                    file=root / path,
                    category=category,
                    meta={
                        "image_id": int(image_id),
                        "class_id": int(class_id),
                        "super_class_id": int(super_id),
                    },
                )
            )
    return SourceDataset(
        name="sop",
        items=items,
        evaluations=[Evaluation(name="test", query="test")],
        split_order=["train", "test"],
        recall_ks=[1, 10, 100, 1000],
        sampling_hints={"batches_per_pair": 5},
    )
