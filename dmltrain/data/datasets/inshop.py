"""In-Shop Clothes Retrieval: Eval/list_eval_partition.txt (image_name item_id evaluation_status).

Splits train / query / gallery as listed; test = queries against the gallery. Categories are the 23
`MEN/Denim`-style folders; FastAP samples 2 batches per category pair (supplement A)."""

from __future__ import annotations

from pathlib import Path

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, find_file
from dmltrain.data.metadata import Evaluation

STATUSES = ("train", "query", "gallery")
_ROOT_SAMPLE = 50  # listed images looked up to find the image root


def scan_inshop(source: Path) -> SourceDataset:
    list_file = find_file(source, ["Eval/list_eval_partition.txt", "list_eval_partition.txt"], "inshop")
    lines = [ln for ln in list_file.read_text().splitlines() if ln.strip()]
    if len(lines) < 2 or not lines[0].strip().isdigit() or lines[1].split()[:2] != ["image_name", "item_id"]:
        raise SourceLayoutError(
            f"inshop: {list_file} should start with the image count and "
            "'image_name item_id evaluation_status'"
        )
    rows = []
    for number, line in enumerate(lines[2:], start=3):
        parts = line.split()
        if len(parts) != 3 or parts[2] not in STATUSES:
            raise SourceLayoutError(
                f"inshop: {list_file}:{number}: expected 'path item_id {'|'.join(STATUSES)}'"
            )
        rows.append(parts)
    if int(lines[0]) != len(rows):
        raise SourceLayoutError(f"inshop: {list_file} announces {lines[0]} images but lists {len(rows)}")
    root = _image_root(source, list_file, [path for path, _, _ in rows])
    items = []
    for path, item_id, status in rows:
        parts = path.split("/")
        category = "/".join(parts[1:3]) if len(parts) >= 4 else None
        meta = {"item_id": item_id}
        items.append(SourceItem(status, item_id, path, file=root / path, category=category, meta=meta))
    return SourceDataset(
        name="inshop",
        items=items,
        evaluations=[Evaluation(name="test", query="query", gallery="gallery")],
        split_order=list(STATUSES),
        recall_ks=[1, 10, 20, 30, 40, 50],
        sampling_hints={"batches_per_pair": 2},
    )


def _image_root(source: Path, list_file: Path, paths: list[str]) -> Path:
    """Paths start with `img/`; the folder holding `img/` is the source, `Img/` or the list's parent: the
    one where most of the first listed images are (one missing image must not decide it)."""
    candidates = [source, source / "Img", list_file.parent, list_file.parent.parent / "Img"]
    sample = paths[:_ROOT_SAMPLE]
    found = [sum((root / p).is_file() for p in sample) for root in candidates]
    if sample and max(found) == 0:
        raise SourceLayoutError(
            f"inshop: none of the first {len(sample)} listed images (e.g. {sample[0]}) is under "
            + ", ".join(str(c) for c in dict.fromkeys(candidates))
        )
    return candidates[found.index(max(found))] if sample else source
