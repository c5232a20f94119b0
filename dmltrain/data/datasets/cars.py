"""Cars196: `cars_annos.mat` (fields relative_im_path, class, test; class_names) or the same columns
in `cars_annos.csv`; classes 1-98 train, 99-196 test (DML convention; the `test` flag is ignored)."""

from __future__ import annotations

import csv
from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError
from dmltrain.data.metadata import Evaluation


def scan_cars(source: Path) -> SourceDataset:
    if (source / "cars_annos.mat").is_file():
        rows, names = _read_mat(source / "cars_annos.mat")
    elif (source / "cars_annos.csv").is_file():
        rows, names = _read_csv(source / "cars_annos.csv")
    else:
        raise SourceLayoutError(f"cars: neither cars_annos.mat nor cars_annos.csv under {source}")
    num_classes = max((c for _, c in rows), default=0)
    unlisted = sorted(set(range(1, num_classes + 1)) - {c for _, c in rows})
    if min((c for _, c in rows), default=0) < 1 or unlisted:  # class_id - 1 indexes the names
        raise SourceLayoutError(
            f"cars: class ids must run 1..N as in the published cars_annos.mat; found "
            f"{min((c for _, c in rows), default=0)}..{num_classes}"
            + (f", missing {unlisted[:5]}" if unlisted else "")
        )
    items = []
    repeated = {n for n in names if names.count(n) > 1}  # classes are keyed by name: keep two apart
    for rel, class_id in rows:
        name = names[class_id - 1] if class_id - 1 < len(names) else str(class_id)
        name = f"{name} (class {class_id})" if name in repeated else name
        split = "train" if class_id <= num_classes // 2 else "test"
        items.append(SourceItem(split, name, rel, file=source / rel, meta={"class_id": class_id}))
    return SourceDataset(
        name="cars196",
        items=items,
        evaluations=[Evaluation(name="test", query="test")],
        split_order=["train", "test"],
    )


def _read_mat(path: Path) -> tuple[list[tuple[str, int]], list[str]]:
    from scipy.io import loadmat

    mat = loadmat(str(path), squeeze_me=True, struct_as_record=False)
    if "annotations" not in mat:
        raise SourceLayoutError(f"cars: {path} has no 'annotations' variable")
    annotations = mat["annotations"]
    annotations = annotations if hasattr(annotations, "__len__") else [annotations]
    rows = [(str(a.relative_im_path), int(getattr(a, "class"))) for a in annotations]
    names = [str(n) for n in mat.get("class_names", [])]
    return rows, names


def _read_csv(path: Path) -> tuple[list[tuple[str, int]], list[str]]:
    rows: list[tuple[str, int]] = []
    names: dict[int, str] = {}
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if not {"relative_im_path", "class"} <= set(reader.fieldnames or []):
            raise SourceLayoutError(f"cars: {path} needs columns relative_im_path,class[,class_name]")
        for row in reader:
            cls = int(row["class"])
            rows.append((row["relative_im_path"], cls))
            if row.get("class_name"):
                names[cls] = row["class_name"]
    ordered = [names.get(i, str(i)) for i in range(1, max((c for _, c in rows), default=0) + 1)]
    return rows, ordered
