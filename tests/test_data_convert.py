"""Converters on tiny fixtures in each data set's published layout, written to real tar shards."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dmltrain.data import ensure_glyphs, load_dataset_info, prepare
from dmltrain.data.conversion import prepare_dataset
from dmltrain.data.datasets.base import SourceDataset, SourceLayoutError
from dmltrain.data.datasets.glyphs import base_character, faithful_codepoints, font_files, scan_glyphs
from dmltrain.data.shards import read_shard
from dmltrain.service.cli import main as cli_main


def write_image(path: Path, seed: int, fmt: str = "JPEG", size: int = 12) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, format=fmt)


def read_all(root: Path, split: str) -> list[tuple[int, int, dict]]:
    info = load_dataset_info(root)
    out = []
    for i, url in enumerate(info.shard_urls(root, split)):
        for s in read_shard(url, shard=i, with_meta=True):
            out.append((s.cls, s.category, json.loads(s.meta)))
    return out


def test_folder_round_trip_reports_corrupt_and_singleton(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = tmp_path / "src"
    counts = {"ant": 5, "bee": 4, "cat": 2, "dog": 6}
    for c, n in counts.items():
        for i in range(n):
            write_image(src / c / f"{i}.jpg", hash((c, i)) % 1000, "PNG" if i % 2 else "JPEG")
    (src / "cat" / "1.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")  # cat keeps one image
    truncated = (src / "dog" / "0.jpg").read_bytes()
    (src / "dog" / "0.jpg").write_bytes(truncated[: len(truncated) // 2])
    out = tmp_path / "out"
    info = prepare("folder", str(src), out, shard_size=3, test_fraction=0.25, seed=1, progress=False)
    err = capsys.readouterr().err
    assert "cat/1.jpg" in err and "dog/0.jpg" in err and "single image" in err
    assert sorted(s.path for s in info.skipped) == ["cat/1.jpg", "dog/0.jpg"]
    assert all(s.reason for s in info.skipped)
    expected = Counter({"ant": 5, "bee": 4, "cat": 1, "dog": 5})
    got: Counter[str] = Counter()
    for split in info.splits:
        for cls, _, meta in read_all(out, split):
            assert info.class_names[cls] == meta["class"] == meta["path"].split("/")[0]
            assert meta["split"] == split
            got[meta["class"]] += 1
        assert sum(s.num_samples for s in info.splits[split].shards) == info.splits[split].num_samples
    assert got == expected
    assert {info.class_names[c] for s in info.splits.values() for c in s.singleton_classes} == {"cat"}
    test_classes = {info.class_names[c] for c, _ in info.splits["test"].shards[0].class_counts}
    assert len(test_classes) == 1 and not test_classes & {
        info.class_names[c] for sh in info.splits["train"].shards for c, _ in sh.class_counts
    }
    assert info.evaluations[0].query == "test" and info.evaluations[0].gallery is None


def three_classes_of_four(src: Path) -> Path:
    """A folder source of 3 classes x 4 PNG images."""
    for c in range(3):
        for i in range(4):
            write_image(src / f"c{c}" / f"{i}.png", c * 10 + i, "PNG")
    return src


def test_prepare_is_idempotent_and_deterministic(tmp_path: Path) -> None:
    src = three_classes_of_four(tmp_path / "src")
    out = tmp_path / "out"
    prepare("folder", str(src), out, shard_size=4, progress=False)
    shards = sorted(out.glob("*.tar"))
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in shards}
    prepare("folder", str(src), out, shard_size=4, progress=False)
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(out.glob("*.tar"))} == before
    prepare("folder", str(src), out, shard_size=4, progress=False, force=True)
    assert {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))} == {k: v[1] for k, v in before.items()}
    prepare("folder", str(src), out, shard_size=6, progress=False)  # new layout: stale shards removed
    info = load_dataset_info(out)
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(s.name for s in info.splits["train"].shards)
    assert not list(out.glob("*.tmp*"))


def test_a_build_never_replaces_other_files_or_another_kind_of_data_set(tmp_path: Path) -> None:
    """`data.prepare: glyphs` with data.root at the user's own data set rebuilt it as glyphs (its shards
    replaced, the rest deleted), and a typo'd root such as /tmp got 128 shards among its files."""
    src = three_classes_of_four(tmp_path / "src")
    mine = tmp_path / "mine"
    prepare("folder", str(src), mine, shard_size=4, progress=False)
    before = {p.name: p.read_bytes() for p in mine.iterdir() if p.suffix in (".tar", ".json")}
    with pytest.raises(FileExistsError, match=rf"{mine} holds a 'folder' data set .*preparing 'glyphs' data"):
        ensure_glyphs(mine, min_faces=12, image_size=32)
    assert {p.name: p.read_bytes() for p in mine.iterdir() if p.suffix in (".tar", ".json")} == before
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    (busy / ".hidden").write_text("ignored")
    with pytest.raises(
        FileExistsError, match=r"busy holds files that are not a dmltrain data set \(notes.txt\)"
    ):
        prepare("folder", str(src), busy, shard_size=4, progress=False)
    assert sorted(p.name for p in busy.iterdir()) == [".hidden", "notes.txt"]
    assert cli_main(["prepare", "folder", str(src), str(busy), "--quiet"]) == 2
    # A fresh volume's root (lost+found) is empty enough; shards of any split name are a build's own.
    volume = tmp_path / "volume"
    (volume / "lost+found").mkdir(parents=True)
    prepare("folder", str(src), volume, shard_size=4, progress=False)
    (volume / "val-1-00000.tar").write_bytes(b"")  # a split named val-1 (a CSV's split column)
    prepare("folder", str(src), volume, shard_size=4, progress=False, force=True)
    assert not (volume / "val-1-00000.tar").exists()  # no longer listed: removed as stale
    # A dataset.json this version refuses (hand-edited totals) is one line naming the way out.
    raw = json.loads((volume / "dataset.json").read_text())
    raw["splits"]["train"]["num_samples"] += 1
    (volume / "dataset.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError, match=r"is not a valid dataset.json .*`dmltrain prepare --force` rebuilds"
    ):
        prepare("folder", str(src), volume, shard_size=4, progress=False)
    prepare("folder", str(src), volume, shard_size=4, progress=False, force=True)


def test_a_re_run_repairs_a_build_that_lost_or_cut_a_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The same options again used to say "up to date" over a deleted or truncated shard: a re-run is
    how a user repairs a copy, so the build is checked file by file and rebuilt when a shard is off."""
    src = three_classes_of_four(tmp_path / "src")
    out = tmp_path / "out"
    info = prepare("folder", str(src), out, shard_size=4, progress=False)
    shards = [out / s.name for s in info.splits["train"].shards]
    assert all(s.size_bytes == (out / s.name).stat().st_size for s in info.splits["train"].shards)
    intact = {p.name: p.read_bytes() for p in shards}
    shards[0].unlink()
    shards[1].write_bytes(intact[shards[1].name][:1000])
    capsys.readouterr()
    prepare("folder", str(src), out, shard_size=4, progress=True)
    err = capsys.readouterr().err
    assert f"rebuilding: shard {shards[0].name} is missing; shard {shards[1].name} has 1000 bytes" in err, err
    assert "up to date" not in err
    assert {p.name: p.read_bytes() for p in shards} == intact
    prepare("folder", str(src), out, shard_size=4, progress=True)
    assert "up to date" in capsys.readouterr().err
    # A build reused without a rescan (the glyph set's path: reuse_if) checks the same files once more
    # after the scan; the damage is said once.
    from dmltrain.data.datasets import scan_source

    shards[0].unlink()
    prepare_dataset(
        lambda: scan_source("folder", str(src)),
        out,
        source_format="folder",
        source_desc=str(src.resolve()),
        shard_size=4,
        reuse_if=lambda old: True,
    )
    assert capsys.readouterr().err.count("rebuilding:") == 1


def test_csv_with_categories_and_splits(tmp_path: Path) -> None:
    rows = ["path,class,category,split"]
    for i in range(12):
        write_image(tmp_path / "img" / f"{i}.jpg", i)
        rows.append(
            f"img/{i}.jpg,k{i % 4},{'vehicle' if i % 4 < 2 else 'animal'},{'train' if i < 8 else 'test'}"
        )
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    info = prepare("csv", str(tmp_path / "list.csv"), tmp_path / "out", progress=False)
    assert info.category_names == ["animal", "vehicle"]
    assert [
        info.category_names[info.class_to_category[info.class_names.index(f"k{k}")]] for k in range(4)
    ] == [
        "vehicle",
        "vehicle",
        "animal",
        "animal",
    ]
    assert info.splits["train"].num_samples == 8 and info.splits["test"].num_samples == 4
    # A class listed under two categories (its samples carried both; class_to_category kept the last; then
    # the build stopped, which an In-Shop item filed under two category folders would do to the whole set)
    rows[5] = rows[5].replace(",vehicle,", ",animal,")
    (tmp_path / "list.csv").write_text("\n".join(rows) + "\n")
    mixed = prepare("csv", str(tmp_path / "list.csv"), tmp_path / "out2", progress=False)
    k0 = mixed.class_names.index("k0")
    assert mixed.category_names[mixed.class_to_category[k0]] == "vehicle"  # 2 of its 3 images
    assert "1 class(es) had images in more than one category; each takes its most common one: k0 " in (
        " ".join(mixed.notes)
    )
    categories = {category for cls, category, _ in read_all(tmp_path / "out2", "train") if cls == k0}
    assert categories == {mixed.class_to_category[k0]}  # every sample of the class carries it too


def test_a_class_in_train_and_an_evaluation_is_noted(tmp_path: Path) -> None:
    """train/dog and test/dog (or a list's split column) built one class in both splits without a word:
    its test metrics measure a class the model trains on."""
    for split, names in (("train", ("cat", "dog")), ("test", ("dog", "emu"))):
        for name in names:
            for j in range(2):
                write_image(tmp_path / "src" / split / name / f"{j}.jpg", j)
    info = prepare("folder", str(tmp_path / "src"), tmp_path / "out", progress=False)
    assert info.notes == [
        "evaluation 'test': 1 of its 2 classes are also in train (its metrics are not held-out figures "
        "for them): dog"
    ]


def test_split_folders_and_values_in_any_case(tmp_path: Path) -> None:
    """Train/ and Test/ were read as two classes (every class of a split merged into one); a list's Train
    and Test values became two evaluated splits and no train split; a BOM broke the header."""
    for split in ("Train", "Test"):
        for name in ("a", "b") if split == "Train" else ("c", "d"):
            for j in range(2):
                write_image(tmp_path / "src" / split / name / f"{j}.jpg", j)
    info = prepare("folder", str(tmp_path / "src"), tmp_path / "out", progress=False)
    assert sorted(info.splits) == ["test", "train"] and info.splits["train"].num_classes == 2
    assert [(e.name, e.query) for e in info.evaluations] == [("test", "test")]
    (tmp_path / "src" / "train" / "e").mkdir(parents=True)
    with pytest.raises(SourceLayoutError, match=r"two folders for split 'train' \(Train/, train/\)"):
        prepare("folder", str(tmp_path / "src"), tmp_path / "out_twins", progress=False)
    rows = ["path,class,split"] + [
        f"src/{split}/{name}/{j}.jpg,{name},{split}"
        for split, names in (("Train", "ab"), ("Test", "cd"))
        for name in names
        for j in range(2)
    ]
    (tmp_path / "list.csv").write_text("\ufeff" + "\r\n".join(rows) + "\r\n", encoding="utf-8")
    listed = prepare("csv", str(tmp_path / "list.csv"), tmp_path / "out_csv", progress=False)
    assert sorted(listed.splits) == ["test", "train"] and listed.splits["test"].num_samples == 4
    # ... but a class folder named Train beside other class folders stays a class, as it was
    for name in ("Bus", "Car", "Train", "Truck"):
        for j in range(2):
            write_image(tmp_path / "vehicles" / name / f"{j}.jpg", j)
    vehicles = prepare("folder", str(tmp_path / "vehicles"), tmp_path / "out_vehicles", progress=False)
    assert vehicles.class_names == ["Bus", "Car", "Train", "Truck"] and list(vehicles.splits) == ["train"]
    # a Kaggle-style Train/ Test/ Validation/ of class folders: refused (Validation is no split name), not
    # built as three classes each merging its classes
    for split, name in (("Train", "dog"), ("Train", "cat"), ("Test", "dog"), ("Validation", "cat")):
        write_image(tmp_path / "kaggle" / split / name / "0.jpg", 0)
    with pytest.raises(
        SourceLayoutError, match=r"split folders \(Test/, Train/\) beside folders with images"
    ):
        prepare("folder", str(tmp_path / "kaggle"), tmp_path / "out_kaggle", progress=False)
    (tmp_path / "cp1252.csv").write_bytes("path,class\nimg/caf\xe9.jpg,a\n".encode("cp1252"))
    with pytest.raises(SourceLayoutError, match=r"cp1252.csv is not UTF-8 text .*save it as UTF-8$"):
        prepare("csv", str(tmp_path / "cp1252.csv"), tmp_path / "out_cp", progress=False)


def test_sop_layout(tmp_path: Path) -> None:
    src = tmp_path / "Stanford_Online_Products"
    lines = {
        "train": ["image_id class_id super_class_id path"],
        "test": ["image_id class_id super_class_id path"],
    }
    image_id = 0
    for class_id, (category, super_id) in enumerate(
        [("bicycle", 1), ("bicycle", 1), ("chair", 3), ("mug", 8)], 1
    ):
        split = "train" if class_id <= 3 else "test"
        for j in range(3):
            image_id += 1
            rel = f"{category}_final/{class_id}0{j}_{j}.JPG"
            write_image(src / rel, image_id)
            lines[split].append(f"{image_id} {class_id} {super_id} {rel}")
    for split, name in (("train", "Ebay_train.txt"), ("test", "Ebay_test.txt")):
        (src / name).write_text("\n".join(lines[split]) + "\n")
    info = prepare("sop", str(tmp_path), tmp_path / "out", progress=False)
    assert (info.splits["train"].num_classes, info.splits["test"].num_classes) == (3, 1)
    assert info.category_names == ["bicycle", "chair", "mug"]
    assert info.recall_ks == [1, 10, 100, 1000] and info.sampling_hints["batches_per_pair"] == 5
    meta = read_all(tmp_path / "out", "test")[0][2]
    assert meta["path"].startswith("mug_final/") and meta["class_id"] == 4 and meta["super_class_id"] == 8


def test_inshop_layout(tmp_path: Path) -> None:
    rows = []
    for item, (gender, cat) in enumerate([("WOMEN", "Dresses"), ("MEN", "Denim"), ("WOMEN", "Dresses")], 1):
        for j, status in enumerate(["train", "train"] if item == 1 else ["query", "gallery", "gallery"]):
            rel = f"img/{gender}/{cat}/id_{item:08d}/0{j}_1_front.jpg"
            write_image(tmp_path / "Img" / rel, item * 10 + j)
            rows.append(f"{rel} id_{item:08d} {status}")
    (tmp_path / "Eval").mkdir()
    text = f"{len(rows)}\nimage_name item_id evaluation_status\n" + "\n".join(rows) + "\n"
    (tmp_path / "Eval" / "list_eval_partition.txt").write_text(text)
    info = prepare("inshop", str(tmp_path), tmp_path / "out", progress=False)
    assert set(info.splits) == {"train", "query", "gallery"}
    assert (info.splits["query"].num_samples, info.splits["gallery"].num_samples) == (2, 4)
    assert info.evaluations[0].model_dump() == {"name": "test", "query": "query", "gallery": "gallery"}
    assert info.category_names == ["MEN/Denim", "WOMEN/Dresses"]


def test_vehicleid_layout(tmp_path: Path) -> None:
    root = tmp_path / "VehicleID_V1.0"
    (root / "train_test_split").mkdir(parents=True)
    (root / "attribute").mkdir()
    image = 0
    lists: dict[str, list[str]] = {
        "train_list": [],
        "test_list_800": [],
        "test_list_1600": [],
        "test_list_2400": [],
    }
    for vehicle in range(1, 9):
        for _ in range(2):
            image += 1
            write_image(root / "image" / f"{image:07d}.jpg", image)
            row = f"{image:07d} {vehicle}"
            if vehicle <= 4:
                lists["train_list"].append(row)
                continue
            lists["test_list_2400"].append(row)  # the published lists are nested: 800 < 1600 < 2400
            if vehicle <= 7:
                lists["test_list_1600"].append(row)
            if vehicle == 5:
                lists["test_list_800"].append(row)
    for name, rows in lists.items():
        (root / "train_test_split" / f"{name}.txt").write_text("\n".join(rows) + "\n")
    (root / "attribute" / "model_attr.txt").write_text("1 7\n2 7\n3 9\n")  # vehicle 4 unlabelled
    info = prepare("vehicleid", str(tmp_path), tmp_path / "out", progress=False)
    assert [e.query for e in info.evaluations] == ["test_small", "test_medium", "test_large"]
    assert [info.splits[f"test_{s}"].num_classes for s in ("small", "medium", "large")] == [1, 3, 4]
    assert info.category_names == ["7", "9"]
    train = read_all(tmp_path / "out", "train")
    assert sorted(
        Counter(info.category_names[c] if c >= 0 else None for _, c, _ in train).items(), key=str
    ) == [
        ("7", 4),
        ("9", 2),
        (None, 2),
    ]
    assert info.recall_ks == [1, 5]


def test_inaturalist_smooth_ap_split(tmp_path: Path) -> None:
    lines: dict[str, list[str]] = {"train": [], "test": []}
    for k, (sup, species) in enumerate(
        [("Aves", "2761"), ("Aves", "2762"), ("Plantae", "5000"), ("Insecta", "90")]
    ):
        for j in range(2):
            rel = f"train_val2018/{sup}/{species}/{k}{j}abc.jpg"
            write_image(tmp_path / rel, k * 10 + j)
            lines["train" if k < 3 else "test"].append(rel)
    (tmp_path / "Inat_dataset_splits").mkdir()
    for split in lines:
        (tmp_path / "Inat_dataset_splits" / f"Inaturalist_{split}_set1.txt").write_text(
            "\n".join(lines[split])
        )
    info = prepare("inaturalist", str(tmp_path), tmp_path / "out", progress=False)
    assert info.class_names == ["Aves/2761", "Aves/2762", "Plantae/5000", "Insecta/90"]
    assert info.splits["train"].num_categories == 2 and info.splits["test"].num_classes == 1
    assert info.recall_ks == [1, 4, 16, 32]
    # iNaturalist's own download (train2018.json, no retrieval split): the message says where the split is
    (tmp_path / "Inat_dataset_splits" / "Inaturalist_test_set1.txt").unlink()
    with pytest.raises(SourceLayoutError, match=r"retrieval split is Smooth-AP's .*give --split-dir$"):
        prepare("inaturalist", str(tmp_path), tmp_path / "out2", progress=False)


def test_cub_layout(tmp_path: Path) -> None:
    root = tmp_path / "CUB_200_2011"
    names = [
        "001.Black_footed_Albatross",
        "002.Laysan_Albatross",
        "003.Sooty_Albatross",
        "004.Groove_billed_Ani",
    ]
    images, labels = [], []
    for c, name in enumerate(names, 1):
        for j in range(2):
            rel = f"{name}/{name[4:]}_{j}.jpg"
            write_image(root / "images" / rel, c * 10 + j)
            images.append(f"{len(images) + 1} {rel}")
            labels.append(f"{len(labels) + 1} {c}")
    (root / "images.txt").write_text("\n".join(images))
    (root / "image_class_labels.txt").write_text("\n".join(labels))
    (root / "classes.txt").write_text("\n".join(f"{i} {n}" for i, n in enumerate(names, 1)))
    info = prepare("cub", str(tmp_path), tmp_path / "out", progress=False)
    assert info.class_names == names
    assert info.splits["train"].num_classes == 2 and info.splits["test"].num_classes == 2


@pytest.mark.parametrize("kind", ["mat", "csv"])
def test_cars_layout(tmp_path: Path, kind: str) -> None:
    rows = []
    for i in range(8):
        rel = f"car_ims/{i + 1:06d}.jpg"
        write_image(tmp_path / rel, i)
        rows.append((rel, i // 2 + 1, i % 2))
    names = ["AM General Hummer SUV 2000", "Acura RL Sedan 2012", "Audi R8 Coupe 2012", "BMW M3 Coupe 2012"]
    if kind == "mat":
        from scipy.io import savemat

        dtype = [("relative_im_path", object), ("bbox_x1", object), ("class", object), ("test", object)]
        annotations = np.array([(r, 0, c, t) for r, c, t in rows], dtype=dtype)
        savemat(
            tmp_path / "cars_annos.mat",
            {"annotations": annotations, "class_names": np.array(names, dtype=object)},
        )
    else:
        text = "relative_im_path,class,class_name\n" + "".join(
            f"{r},{c},{names[c - 1]}\n" for r, c, _ in rows
        )
        (tmp_path / "cars_annos.csv").write_text(text)
    info = prepare("cars", str(tmp_path), tmp_path / "out", progress=False)
    assert info.class_names == names
    assert [info.splits[s].num_samples for s in ("train", "test")] == [4, 4]


def test_cars_devkit_layout(tmp_path: Path) -> None:
    """The devkit release (torchvision's StanfordCars, Kaggle): two annotation files whose image names repeat
    across cars_train/ and cars_test/, class names in devkit/cars_meta.mat. It was refused."""
    from scipy.io import savemat

    names = ["AM General Hummer SUV 2000", "Acura RL Sedan 2012", "Audi R8 Coupe 2012", "BMW M3 Coupe 2012"]
    dtype = [("bbox_x1", object), ("bbox_y1", object), ("class", object), ("fname", object)]
    (tmp_path / "devkit").mkdir()
    for folder, annos, first in (
        ("cars_train", tmp_path / "devkit" / "cars_train_annos.mat", 0),
        ("cars_test", tmp_path / "cars_test_annos_withlabels.mat", 4),
    ):
        records = []
        for i in range(4):  # every class in both halves, as in the release
            fname = f"{i + 1:05d}.jpg"
            write_image(tmp_path / folder / fname, first + i)
            records.append((0, 0, i + 1, fname))
        savemat(annos, {"annotations": np.array(records, dtype=dtype)})
    savemat(tmp_path / "devkit" / "cars_meta.mat", {"class_names": np.array(names, dtype=object)})
    info = prepare("cars", str(tmp_path), tmp_path / "out", progress=False)
    assert info.class_names == names
    assert [info.splits[s].num_samples for s in ("train", "test")] == [4, 4]  # classes 1-2 / 3-4, both halves
    assert {m["path"] for _, _, m in read_all(tmp_path / "out", "train")} == {
        f"{folder}/{i:05d}.jpg" for folder in ("cars_train", "cars_test") for i in (1, 2)
    }
    (tmp_path / "cars_test_annos_withlabels.mat").unlink()
    with pytest.raises(SourceLayoutError, match=r"without cars_test_annos_withlabels.mat"):
        prepare("cars", str(tmp_path), tmp_path / "out2", progress=False)


def test_cli_prepare(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    for i in range(4):
        write_image(tmp_path / "src" / f"c{i % 2}" / f"{i}.png", i, "PNG")
    assert cli_main(["prepare", "folder", str(tmp_path / "src"), str(tmp_path / "out"), "--quiet"]) == 0
    assert "4 images, 2 classes" in capsys.readouterr().out
    assert cli_main(["prepare", "sop", str(tmp_path / "nothing"), str(tmp_path / "o2"), "--quiet"]) == 2
    assert "Ebay_train.txt" in capsys.readouterr().err
    done = subprocess.run(
        [sys.executable, "-m", "dmltrain.service.cli", "prepare", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "inaturalist" in done.stdout


def test_cli_prepare_refuses_sizes_that_would_ruin_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    for i in range(4):
        write_image(tmp_path / "src" / f"c{i % 2}" / f"{i}.png", i, "PNG")
    # --resize 0 used to write every image as 1 x 1 pixel, and exit 0
    for option, value in (
        ("--resize", "0"),
        ("--shard-size", "0"),
        ("--resize", "-5"),
        ("--test-fraction", "1"),
    ):
        with pytest.raises(SystemExit) as stopped:
            cli_main(["prepare", "folder", str(tmp_path / "src"), str(tmp_path / "out"), option, value])
        assert stopped.value.code == 2
        assert f"argument {option}: must be" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    (tmp_path / "file").write_text("x")
    assert cli_main(["prepare", "folder", str(tmp_path / "src"), str(tmp_path / "file"), "--quiet"]) == 2
    assert capsys.readouterr().err.startswith("dmltrain prepare: error:")


def test_folder_says_what_it_did_not_read(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Nothing left out unsaid: JPEG's other suffixes are images; hidden and archive folders, empty class
    folders and files that are no images are named in notes (dataset.json and stderr)."""
    src = tmp_path / "src"
    for c in ("ant", "bee"):
        for i in range(3):
            write_image(src / c / f"{i}.jpg", i, "JPEG")
    write_image(src / "cat" / "0.jfif", 7, "JPEG")
    write_image(src / "cat" / "1.jpe", 8, "JPEG")
    (src / "cat" / "labels.txt").write_text("not an image")
    (src / "cat" / ".DS_Store").write_bytes(b"\0")
    (src / "empty").mkdir()
    write_image(src / ".ipynb_checkpoints" / "0.jpg", 9, "JPEG")
    write_image(src / "__MACOSX" / "ant" / "._0.jpg", 10, "JPEG")
    info = prepare("folder", str(src), tmp_path / "out", progress=True)
    assert info.class_names == ["ant", "bee", "cat"] and info.splits["train"].num_samples == 8
    notes = "\n".join(info.notes)
    assert ".ipynb_checkpoints/ is a hidden or archive folder" in notes and "__MACOSX/ is a hidden" in notes
    assert "1 class folder(s) hold no images and are not classes: empty" in notes
    assert "1 file(s) without an image suffix" in notes and "cat/labels.txt" in notes
    assert ".DS_Store" not in notes
    err = capsys.readouterr().err
    assert all(f"note: {note}" in err for note in info.notes)


def test_a_test_fraction_the_layout_cannot_use_is_refused(tmp_path: Path) -> None:
    """A layout with its own splits (split folders, a csv split column) ignored --test-fraction silently:
    the user believed classes were held out as asked."""
    for split, cls in (("train", "ant"), ("train", "bee"), ("test", "cat")):
        for i in range(2):
            write_image(tmp_path / "src" / split / cls / f"{i}.jpg", i)
    with pytest.raises(
        SourceLayoutError, match=r"has split folders \(test/, train/\).*test fraction \(0.2\)"
    ):
        prepare("folder", str(tmp_path / "src"), tmp_path / "out", test_fraction=0.2, progress=False)
    info = prepare("folder", str(tmp_path / "src"), tmp_path / "out", progress=False)
    assert info.splits["test"].num_classes == 1
    (tmp_path / "list.csv").write_text(
        "path,class,split\ntrain/ant/0.jpg,ant,train\ntest/cat/0.jpg,cat,test\n"
    )
    with pytest.raises(SourceLayoutError, match=r"has a split column.*test fraction \(0.5\)"):
        prepare(
            "csv",
            str(tmp_path / "list.csv"),
            tmp_path / "out2",
            image_root=tmp_path / "src",
            test_fraction=0.5,
            progress=False,
        )


def test_a_build_where_no_image_could_be_read_is_an_error(tmp_path: Path) -> None:
    """Not a 0-image dataset.json and exit 0: `prepare && train` must stop at prepare."""
    for i in range(3):
        path = tmp_path / "src" / f"c{i}" / "0.jpg"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"no jpeg")
    unread = r"none of its 3 image file\(s\) could be read"
    with pytest.raises(
        SourceLayoutError, match=unread + r" \(first: c\d/0.jpg: UnidentifiedImageError: [^<]*\)$"
    ):
        prepare("folder", str(tmp_path / "src"), tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_base_character_strips_accents_only() -> None:
    assert [base_character(c) for c in "aáàâäA"] == ["a"] * 5 + ["A"]
    assert base_character("ǆ") == "d" and base_character("ß") == "ß"


def test_glyph_faces_are_checked_for_real_coverage() -> None:
    faces = {p.name: p for p in font_files()}
    assert (
        not faithful_codepoints(faces["LastResortHE-Regular.ttf"])
        or len(faithful_codepoints(faces["LastResortHE-Regular.ttf"])) < 1000
    )  # a placeholder font does not cover everything
    assert ord("!") not in faithful_codepoints(faces["cmex10.ttf"])  # TeX-encoded: '!' is a bracket piece
    assert ord("A") in faithful_codepoints(faces["DejaVuSans.ttf"])


def test_small_glyph_build(tmp_path: Path) -> None:
    source = scan_glyphs(min_faces=12, image_size=32, max_classes=40)
    classes = Counter(it.class_name for it in source.items)
    assert len(classes) == 40 and min(classes.values()) >= 12
    for it in source.items[:50]:
        assert unicodedata.category(it.meta["char"])[0] in "LN"
        assert it.category.endswith(base_character(it.meta["char"]))
    info = prepare("glyphs", "-", tmp_path, min_faces=12, image_size=32, max_classes=40, progress=False)
    assert info.num_classes == 40 and info.splits["train"].num_classes == 20
    image = Image.open(__import__("io").BytesIO(next(read_shard(info.shard_urls(tmp_path, "train")[0])).data))
    assert image.size == (32, 32)


def test_an_evaluation_of_a_split_without_images_is_left_out_and_said(tmp_path: Path) -> None:
    """--test-fraction 0 wrote an evaluation of a 'test' split that has no images; dataset.json now
    refuses that on read, so the build leaves the evaluation out with a note instead."""
    info = prepare(
        "glyphs", "-", tmp_path, min_faces=12, image_size=32, max_classes=8, test_fraction=0.0, progress=False
    )
    assert info.evaluations == [] and "test" not in info.splits
    assert "evaluation 'test' left out: split 'test' has no images" in info.notes
    assert load_dataset_info(tmp_path) == info


def test_glyph_build_same_with_worker_processes(tmp_path: Path) -> None:
    """Rendering and shard writing in forked workers give the sequential build's items and bytes."""

    def items(source: SourceDataset) -> list[tuple[str, str, str, bytes | None]]:
        return [(it.split, it.class_name, it.path, it.data) for it in source.items]

    one = scan_glyphs(min_faces=12, image_size=32, max_classes=40)
    two = scan_glyphs(min_faces=12, image_size=32, max_classes=40, workers=2)
    assert len(one.items) >= 480 and items(two) == items(one)
    shards = {}
    for workers in (1, 2):
        out = tmp_path / f"workers{workers}"
        prepare_dataset(
            lambda: one, out, source_format="glyphs", source_desc="test", shard_size=64, workers=workers
        )
        shards[workers] = {p.name: p.read_bytes() for p in sorted(out.glob("*.tar"))}
    assert len(shards[1]) > 2 and shards[2] == shards[1]


def test_default_glyphs_two_processes_build_once(tmp_path: Path) -> None:
    code = "import sys; from dmltrain.data import ensure_glyphs; print(ensure_glyphs(sys.argv[1]))"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)]) for _ in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    info = load_dataset_info(tmp_path)
    assert info.num_classes >= 1000 and info.num_categories < info.num_classes
    assert min(n for s in info.splits.values() for sh in s.shards for _, n in sh.class_counts) >= 1
    assert set(info.splits) == {"train", "test"} and not info.skipped
    assert ensure_glyphs(tmp_path) == tmp_path


def test_inshop_root_survives_a_missing_first_image_and_unanswerable_queries_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The image root was guessed from the first listed image alone: that one missing, every image was
    skipped. Query and gallery splits warned of single-image classes (normal there) but not of a query item
    with no gallery image (its queries have no positive)."""
    rows = []
    for item in range(1, 5):
        for j, status in enumerate(["query", "gallery"]):
            rel = f"img/MEN/Denim/id_{item:08d}/0{j}_1_front.jpg"
            if (item, j) not in {(1, 0), (4, 1)}:  # the first listed image and item 4's gallery image
                write_image(tmp_path / "Img" / rel, item * 10 + j)
            rows.append(f"{rel} id_{item:08d} {status}")
    (tmp_path / "Eval").mkdir()
    text = f"{len(rows)}\nimage_name item_id evaluation_status\n" + "\n".join(rows) + "\n"
    (tmp_path / "Eval" / "list_eval_partition.txt").write_text(text)
    info = prepare("inshop", str(tmp_path), tmp_path / "out", progress=False)
    assert (info.splits["query"].num_samples, info.splits["gallery"].num_samples) == (3, 3)
    assert [s.path for s in info.skipped] == [r.split()[0] for r in (rows[0], rows[7])]
    err = capsys.readouterr().err
    assert "single image" not in err
    assert "test: 1 query image(s) of 1 class(es) have no image of their class in gallery" in err
    assert "id_00000004" in err

    (tmp_path / "Img").rename(tmp_path / "elsewhere")
    with pytest.raises(SourceLayoutError, match=r"none of the first 8 listed images \(e.g. img/MEN"):
        prepare("inshop", str(tmp_path), tmp_path / "out2", progress=False)


def test_vehicleid_model_ids_match_as_numbers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A model file with other zero padding than the lists labelled no vehicle, silently."""
    root = tmp_path / "VehicleID_V1.0"
    (root / "train_test_split").mkdir(parents=True)
    (root / "attribute").mkdir()
    for image in range(1, 7):
        write_image(root / "image" / f"{image:07d}.jpg", image)
    train = "0000001 1\n0000002 1\n0000003 2\n0000004 2\n"
    (root / "train_test_split" / "train_list.txt").write_text(train)
    for n in (800, 1600, 2400):
        (root / "train_test_split" / f"test_list_{n}.txt").write_text("0000005 3\n0000006 3\n")
    (root / "attribute" / "model_attr.txt").write_text("0001 7\n0003 9\n")
    info = prepare("vehicleid", str(tmp_path), tmp_path / "out", progress=True)
    assert info.category_names == ["7", "9"]
    assert "1 of 2 training vehicles have a model" in capsys.readouterr().err
    (root / "attribute" / "model_attr.txt").write_text("0003 9\n")
    with pytest.raises(SourceLayoutError, match="labels none of the vehicles"):
        prepare("vehicleid", str(tmp_path), tmp_path / "out2", progress=False)


def test_cars_class_ids_must_run_from_one(tmp_path: Path) -> None:
    """0-based ids in a home-made cars_annos.csv named class 0 after the last class and merged the two."""
    text = "relative_im_path,class\n" + "".join(f"car_ims/{i}.jpg,{i // 2}\n" for i in range(8))
    (tmp_path / "cars_annos.csv").write_text(text)
    with pytest.raises(SourceLayoutError, match=r"class ids must run 1..N .* found 0..3"):
        prepare("cars", str(tmp_path), tmp_path / "out", progress=False)
    # Classes are keyed by name: two ids with one name stayed two classes, not one
    names = ["Audi A4", "BMW M3", "Audi A4", "Ford F150"]
    for i in range(8):
        write_image(tmp_path / "car_ims" / f"{i}.jpg", i)
    text = "relative_im_path,class,class_name\n" + "".join(
        f"car_ims/{i}.jpg,{i // 2 + 1},{names[i // 2]}\n" for i in range(8)
    )
    (tmp_path / "cars_annos.csv").write_text(text)
    info = prepare("cars", str(tmp_path), tmp_path / "out", progress=False)
    assert info.class_names == ["Audi A4 (class 1)", "BMW M3", "Audi A4 (class 3)", "Ford F150"]


def test_folder_split_folders_beside_image_folders_are_refused(tmp_path: Path) -> None:
    """train/ and test/ beside a stray folder of images became three classes (every training class merged
    into one called 'train'), with no word."""
    write_image(tmp_path / "train" / "a" / "0.png", 0, "PNG")
    write_image(tmp_path / "test" / "b" / "0.png", 1, "PNG")
    write_image(tmp_path / "samples" / "x.png", 2, "PNG")
    # hidden and archive folders are neither (a layout unzipped on a Mac keeps its split folders)
    (tmp_path / "__MACOSX" / "train" / "a").mkdir(parents=True)
    (tmp_path / "__MACOSX" / "train" / "a" / "._0.png").write_bytes(b"\0\5\26\7")
    write_image(tmp_path / ".thumbnails" / "x.png", 3, "PNG")
    with pytest.raises(
        SourceLayoutError, match=r"split folders \(test/, train/\) beside folders with images \(samples/\)"
    ):
        prepare("folder", str(tmp_path), tmp_path / "out", progress=False)
    (tmp_path / "samples" / "x.png").unlink()
    (tmp_path / "samples").rmdir()
    info = prepare("folder", str(tmp_path), tmp_path / "out", progress=False)
    assert set(info.splits) == {"train", "test"} and info.class_names == ["a", "b"]
