"""iNaturalist 2018 with the Smooth-AP retrieval split: Inat_dataset_splits/Inaturalist_train_set1.txt
and Inaturalist_test_set1.txt list image paths `train_val2018/<super-category>/<species>/<file>.jpg`
(5,690 train and 2,452 unseen test species). Class = species, category = super-category."""

from __future__ import annotations

from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, find_file
from dmltrain.data.metadata import Evaluation


def scan_inaturalist(source: Path, split_dir: Path | None = None) -> SourceDataset:
    items = []
    for split, name in (("train", "Inaturalist_train_set1.txt"), ("test", "Inaturalist_test_set1.txt")):
        try:
            if split_dir is not None:
                list_file = find_file(split_dir, [name], "inaturalist")
            else:
                list_file = find_file(source, [f"Inat_dataset_splits/{name}", name], "inaturalist")
        except SourceLayoutError as error:  # iNaturalist's own download has no retrieval split
            raise SourceLayoutError(
                f"{error}: the retrieval split is Smooth-AP's (5,690 train / 2,452 test species), published "
                "with that paper as Inat_dataset_splits/; iNaturalist's own train2018.json/val2018.json "
                "divide images, not species. Put the folder under the source or give --split-dir"
            ) from None
        for number, line in enumerate(list_file.read_text().splitlines(), start=1):
            path = line.strip()
            if not path:
                continue
            parts = path.split("/")
            if len(parts) < 3:
                raise SourceLayoutError(
                    f"inaturalist: {list_file}:{number}: expected "
                    f"'.../<super-category>/<species>/<file>', got {path!r}"
                )
            category, species = parts[-3], parts[-2]
            items.append(
                SourceItem(
                    split,
                    f"{category}/{species}",
                    path,
                    file=source / path,
                    category=category,
                    meta={"species_id": species, "super_category": category},
                )
            )
    return SourceDataset(
        name="inaturalist",
        items=items,
        evaluations=[Evaluation(name="test", query="test")],
        split_order=["train", "test"],
        recall_ks=[1, 4, 16, 32],
        options={"split_dir": str(split_dir) if split_dir else None},
    )
