"""PKU VehicleID: image/<id>.jpg, train_test_split/{train_list,test_list_800,1600,2400}.txt
(`<image id> <vehicle id>`), attribute/model_attr.txt (`<vehicle id> <model id>`).

Class = vehicle; category = vehicle model where labelled (about half of the training vehicles), else
unlabelled (-1) - the FastAP VehicleID sampler draws half a batch from one model and half from
unlabelled vehicles (supplement A). The small/medium/large test lists become splits of their own."""

from __future__ import annotations

from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, find_file
from dmltrain.data.metadata import Evaluation

TEST_SETS = (("small", "800"), ("medium", "1600"), ("large", "2400"))


def _read_pairs(path: Path) -> list[tuple[str, str]]:
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            parts = line.split()
            if len(parts) != 2:
                raise SourceLayoutError(f"vehicleid: {path}:{number}: expected '<id> <id>', got {line!r}")
            rows.append((parts[0], parts[1]))
    return rows


def _number(value: str, path: Path) -> int:
    try:
        return int(value)
    except ValueError:
        raise SourceLayoutError(f"vehicleid: {path}: vehicle id {value!r} is not a number") from None


def scan_vehicleid(source: Path) -> SourceDataset:
    candidates = ["train_test_split/train_list.txt", "VehicleID_V1.0/train_test_split/train_list.txt"]
    train_list = find_file(source, candidates, "vehicleid")
    root = train_list.parent.parent
    image_dir = root / "image"
    if not image_dir.is_dir():
        raise SourceLayoutError(f"vehicleid: image folder {image_dir} is missing")
    model_file = root / "attribute" / "model_attr.txt"
    # Ids compared as numbers: a file written with another zero padding would otherwise label nothing.
    models = {_number(v, model_file): m for v, m in _read_pairs(model_file)} if model_file.is_file() else {}
    notes = [] if models else [f"{model_file} missing: no vehicle has a model (category) label"]
    lists = [("train", train_list)]
    lists += [
        (f"test_{size}", find_file(root, [f"train_test_split/test_list_{n}.txt"], "vehicleid"))
        for size, n in TEST_SETS
    ]
    items = []
    for split, list_file in lists:
        for image_id, vehicle in _read_pairs(list_file):
            model = models.get(_number(vehicle, list_file)) if models else None
            items.append(
                SourceItem(
                    split,
                    vehicle,
                    f"image/{image_id}.jpg",
                    file=image_dir / f"{image_id}.jpg",
                    category=model,
                    meta={"image_id": image_id, "vehicle_id": vehicle, "model_id": model},
                )
            )
    if models:
        train = {it.class_name for it in items if it.split == "train"}
        labelled = {it.class_name for it in items if it.split == "train" and it.category is not None}
        notes.append(f"{len(labelled)} of {len(train)} training vehicles have a model ({model_file.name})")
        if not labelled:
            raise SourceLayoutError(
                f"vehicleid: {model_file} labels none of the vehicles in {train_list} (vehicle ids differ?)"
            )
    return SourceDataset(
        name="vehicleid",
        items=items,
        evaluations=[Evaluation(name=size, query=f"test_{size}") for size, _ in TEST_SETS],
        split_order=[s for s, _ in lists],
        recall_ks=[1, 5],
        notes=notes,
    )
