"""Cars196: `cars_annos.mat` (fields relative_im_path, class, test; class_names), the same columns in
`cars_annos.csv`, or the devkit release (`devkit/cars_{meta,train_annos}.mat`,
`cars_test_annos_withlabels.mat`, images in `cars_train/` and `cars_test/`: what torchvision's StanfordCars
and the Kaggle copy ship); classes 1-98 train, 99-196 test (DML convention; the release's own train/test
division is ignored)."""

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
    elif (source / "devkit" / "cars_train_annos.mat").is_file():
        rows, names = _read_devkit(source)
    else:
        raise SourceLayoutError(
            f"cars: none of cars_annos.mat, cars_annos.csv or devkit/cars_train_annos.mat under {source}"
        )
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


def _read_devkit(source: Path) -> tuple[list[tuple[str, int]], list[str]]:
    """Both halves of the devkit release as one list: file names are per folder (00001.jpg in each)."""
    from scipy.io import loadmat

    test = next(
        (
            p
            for p in (
                source / "cars_test_annos_withlabels.mat",
                source / "devkit" / "cars_test_annos_withlabels.mat",
            )
            if p.is_file()
        ),
        None,
    )
    if test is None:
        raise SourceLayoutError(
            f"cars: {source}/devkit/cars_train_annos.mat without cars_test_annos_withlabels.mat (the test "
            f"half's labels, released separately): put it in {source} or devkit/"
        )
    rows: list[tuple[str, int]] = []
    for path, folder in ((source / "devkit" / "cars_train_annos.mat", "cars_train"), (test, "cars_test")):
        mat = loadmat(str(path), squeeze_me=True, struct_as_record=False)
        if "annotations" not in mat:
            raise SourceLayoutError(f"cars: {path} has no 'annotations' variable")
        annotations = mat["annotations"]
        annotations = annotations if hasattr(annotations, "__len__") else [annotations]
        try:
            rows += [(f"{folder}/{a.fname}", int(getattr(a, "class"))) for a in annotations]
        except AttributeError as exc:  # the unlabelled cars_test_annos.mat has no class field
            raise SourceLayoutError(f"cars: {path}: annotations without class labels ({exc})") from None
    meta = source / "devkit" / "cars_meta.mat"
    names = (
        [str(n) for n in loadmat(str(meta), squeeze_me=True).get("class_names", [])] if meta.is_file() else []
    )
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
