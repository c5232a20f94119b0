"""Turn a converter's `SourceDataset` into tar shards plus `dataset.json`, safely and reproducibly.

Layout decisions that the samplers rely on:
- images of one class are written next to each other in groups of at most `group_size`, so a stream
  reader sees several images of a class at once and can batch P x K with a small buffer;
- each category's groups are dealt round-robin over the split's shards, so every shard (and therefore
  every rank) holds some classes of most categories, which lets all ranks serve the same category pair;
- a shard appears only when complete (temporary file + rename) and `dataset.json` is written last, so a
  directory with `dataset.json` is complete; an interrupted run resumes from its finished shards.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from dmltrain.data.datasets import scan_source
from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError, natural_key
from dmltrain.data.datasets.glyphs import glyphs_source_desc
from dmltrain.data.errors import first_few
from dmltrain.data.images import ImageError, checked_image
from dmltrain.data.metadata import (
    METADATA_NAME,
    DatasetInfo,
    Evaluation,
    ShardInfo,
    SkippedFile,
    SplitInfo,
    damaged_shards,
)
from dmltrain.data.pools import process_pool
from dmltrain.data.shards import ShardEntry, ShardRecord, write_shard

log = logging.getLogger(__name__)

PROGRESS_NAME = ".dmltrain-prepare.json"
LOCK_NAME = ".dmltrain.lock"
_SHARD_RE = re.compile(r"^.+-\d{5}\.tar$")  # any split's name (`val-1` too)


@contextlib.contextmanager
def directory_lock(out_dir: Path) -> Iterator[None]:
    """Exclusive lock on `out_dir` so two processes preparing the same data do not interleave."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / LOCK_NAME, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def auto_shard_size(num_items: int) -> int:
    """About 64 shards per split (enough for 8 ranks x 8 loader workers), 64..2000 images each."""
    return int(min(2000, max(64, math.ceil(num_items / 64))))


def prepare_dataset(
    scan: Callable[[], SourceDataset],
    out_dir: str | Path,
    *,
    source_format: str,
    source_desc: str,
    shard_size: int | None = None,
    group_size: int = 32,
    seed: int = 0,
    resize: int | None = None,
    workers: int = 1,
    force: bool = False,
    progress: bool = True,
    reuse_if: Callable[[DatasetInfo], bool] | None = None,
) -> DatasetInfo:
    """Write shards and `dataset.json` into `out_dir`; a no-op when an identical build is already there.

    `scan` runs under the directory lock, after `reuse_if(existing info)` had its chance to skip it.
    """
    out = Path(out_dir)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    _refuse_foreign_folder(out)
    with directory_lock(out):
        existing = out / METADATA_NAME
        old = None
        if existing.is_file() and not force:
            try:
                old = DatasetInfo.model_validate(json.loads(existing.read_text()))
            except ValueError as error:  # pydantic's and json's: several lines, no way out named
                first = " ".join(str(error).split())[:300]
                raise ValueError(
                    f"{existing} is not a valid dataset.json ({first}): `dmltrain prepare --force` "
                    "rebuilds it"
                ) from None
        if old is not None and old.source_format != source_format:
            # `data.prepare: glyphs` with data.root naming the user's own data set rebuilt it as glyphs.
            raise FileExistsError(
                f"{out} holds a {old.source_format!r} data set ({old.source}); preparing {source_format!r} "
                "data there would replace it: choose another folder (or remove it first)"
            )
        # Its shards are checked (and a damaged build reported) once, whichever test below asks first.
        intact = functools.cache(lambda: old is not None and _intact(out, old, progress))
        if old is not None and reuse_if is not None and reuse_if(old) and intact():
            return old
        source = scan()
        fingerprint = _fingerprint(source, source_format, shard_size, group_size, seed, resize)
        if old is not None and old.fingerprint == fingerprint and intact():
            images = sum(s.num_samples for s in old.splits.values())
            _say(progress, f"{out}: up to date ({images} images)")
            return old
        _one_category_per_class(source)
        class_ids, category_ids = _label_ids(source)
        plans = _plan_shards(source, class_ids, category_ids, shard_size, group_size, seed)
        records = _write_all(out, plans, fingerprint, resize, workers, progress)
        info = _build_info(source, source_format, source_desc, fingerprint, class_ids, category_ids, records)
        if not any(split.num_samples for split in info.splits.values()):
            # An error, not a 0-image dataset.json: `prepare && train` must stop at the step that failed.
            first = info.skipped[0] if info.skipped else None
            raise SourceLayoutError(
                f"{source_desc}: none of its {len(source.items)} image file(s) could be read"
                + (f" (first: {first.path}: {first.reason})" if first else "")
            )
        _report(info, progress)
        tmp = out / f"{METADATA_NAME}.tmp-{os.getpid()}"
        tmp.write_text(info.model_dump_json(indent=1))
        os.replace(tmp, existing)
        _remove_stale(out, {s.name for split in info.splits.values() for s in split.shards})
        (out / PROGRESS_NAME).unlink(missing_ok=True)
        return info


def _intact(out: Path, info: DatasetInfo, progress: bool) -> bool:
    """Whether every shard ``dataset.json`` lists is there with the size it was written with. An identical
    build is only "up to date" if its files are: a re-run is how a user repairs a copy that lost or cut a
    shard, so a damaged build is rebuilt (and said so) instead of reported fine."""
    damaged = damaged_shards(info, out)
    if damaged:
        message = f"{out}: rebuilding: {damaged}"
        if progress:
            _say(progress, message)
        else:
            log.warning("%s", message)
    return damaged is None


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr)


def _fingerprint(
    source: SourceDataset,
    source_format: str,
    shard_size: int | None,
    group_size: int,
    seed: int,
    resize: int | None,
) -> str:
    """Hash of everything that determines the output, including each source file's size and mtime."""
    digest = hashlib.sha256()
    head = [source_format, source.name, shard_size, group_size, seed, resize, source.options]
    digest.update(json.dumps(head, sort_keys=True, default=str).encode())
    for item in source.items:
        if item.data is not None:
            stamp = hashlib.sha1(item.data).hexdigest()
        elif item.file is not None:
            try:
                st = item.file.stat()
                stamp = f"{st.st_size}:{st.st_mtime_ns}"
            except OSError:
                stamp = "missing"
        else:
            stamp = "none"
        digest.update(f"{item.split}\0{item.class_name}\0{item.category}\0{item.path}\0{stamp}\n".encode())
    return digest.hexdigest()


def _one_category_per_class(source: SourceDataset) -> None:
    """Give every image of a class its class's most common category (ties: the first in natural order),
    with a note naming the classes changed. FastAP's hard sampling draws classes by category, so a class
    has one; a list that files some of a class's images elsewhere (an In-Shop item under two category
    folders) stopped the whole build."""
    seen: dict[str, Counter[str]] = defaultdict(Counter)
    for item in source.items:
        if item.category is not None:
            seen[item.class_name][item.category] += 1
    mixed = {
        name: min(counts, key=lambda c: (-counts[c], natural_key(c)))
        for name, counts in seen.items()
        if len(counts) > 1
    }
    if not mixed:
        return
    for item in source.items:
        if item.class_name in mixed and item.category is not None:
            item.category = mixed[item.class_name]
    shown = ", ".join(
        f"{name} ({'/'.join(sorted(seen[name], key=natural_key))} -> {category})"
        for name, category in sorted(mixed.items())[:10]
    )
    source.notes.append(
        f"{len(mixed)} class(es) had images in more than one category; each takes its most common one: "
        f"{shown}" + (" ..." if len(mixed) > 10 else "")
    )


def _label_ids(source: SourceDataset) -> tuple[dict[str, int], dict[str, int]]:
    """Class ids in split order then natural name order; category ids in natural name order."""
    rank = {s: i for i, s in enumerate(source.split_order)}
    first_split: dict[str, int] = {}
    categories: set[str] = set()
    category_of: dict[str, str] = {}
    for item in source.items:
        if item.split not in rank:
            raise ValueError(f"item {item.path} has split {item.split!r}, not in {source.split_order}")
        first_split[item.class_name] = min(first_split.get(item.class_name, 99), rank[item.split])
        if item.category is not None:
            categories.add(item.category)
            if category_of.setdefault(item.class_name, item.category) != item.category:  # settled before
                raise AssertionError(f"class {item.class_name!r} is in two categories")
    classes = sorted(first_split, key=lambda c: (first_split[c], natural_key(c)))
    ordered_categories = sorted(categories, key=natural_key)
    return {c: i for i, c in enumerate(classes)}, {c: i for i, c in enumerate(ordered_categories)}


def _plan_shards(
    source: SourceDataset,
    class_ids: dict[str, int],
    category_ids: dict[str, int],
    shard_size: int | None,
    group_size: int,
    seed: int,
) -> list[tuple[str, str, list[tuple[str, SourceItem, int, int]]]]:
    """[(split, shard name, [(key, item, class id, category id)])] - deterministic, before reading data."""
    by_split: dict[str, dict[int, list[SourceItem]]] = defaultdict(lambda: defaultdict(list))
    for item in source.items:
        by_split[item.split][class_ids[item.class_name]].append(item)
    plans = []
    for split_index, split in enumerate(source.split_order):
        classes = by_split.get(split)
        if not classes:
            continue
        rng = np.random.default_rng([seed, split_index])
        groups_by_category: dict[int, list[list[SourceItem]]] = defaultdict(list)
        for cls in sorted(classes):
            items = sorted(classes[cls], key=lambda it: natural_key(it.path))
            category = -1 if items[0].category is None else category_ids[items[0].category]
            parts = math.ceil(len(items) / group_size)
            for chunk in np.array_split(np.arange(len(items)), parts):
                groups_by_category[category].append([items[i] for i in chunk])
        total = sum(len(c) for c in classes.values())
        num_shards = max(1, math.ceil(total / (shard_size or auto_shard_size(total))))
        shards: list[list[list[SourceItem]]] = [[] for _ in range(num_shards)]
        cursor = 0
        for category in sorted(groups_by_category):
            groups = groups_by_category[category]
            for g in rng.permutation(len(groups)):
                shards[cursor % num_shards].append(groups[g])
                cursor += 1
        counter = 0
        for index, shard_groups in enumerate(shards):
            entries = []
            for g in rng.permutation(len(shard_groups)):
                for item in shard_groups[g]:
                    cls = class_ids[item.class_name]
                    category = -1 if item.category is None else category_ids[item.category]
                    entries.append((f"{split}_{counter:08d}", item, cls, category))
                    counter += 1
            plans.append((split, f"{split}-{index:05d}.tar", entries))
    return plans


def _write_all(
    out: Path,
    plans: list[tuple[str, str, list[tuple[str, SourceItem, int, int]]]],
    fingerprint: str,
    resize: int | None,
    workers: int,
    progress: bool,
) -> dict[str, list[ShardRecord]]:
    """Write every planned shard (reusing those an interrupted run with the same inputs finished)."""
    done = _load_progress(out, fingerprint)
    todo = [p for p in plans if not (p[1] in done and (out / p[1]).is_file())]
    total = sum(len(p[2]) for p in todo)
    bar = tqdm(total=total, unit="img", desc=f"writing {out.name}", disable=not progress, file=sys.stderr)

    def finish(record: ShardRecord) -> None:
        for skip in record.skipped:
            bar.write(f"skipped {skip['path']} ({skip['split']}): {skip['reason']}", file=sys.stderr)
        done[record.name] = record
        _save_progress(out, fingerprint, done)
        bar.update(record.num_samples + len(record.skipped))

    try:
        with process_pool(workers if len(todo) > 1 else 1) as pool:
            if pool is None:
                for split, name, entries in todo:
                    finish(_write_one(str(out), split, name, entries, resize))
            else:
                futures = [
                    pool.submit(_write_one, str(out), s, name, entries, resize) for s, name, entries in todo
                ]
                for future in futures:
                    finish(future.result())
    finally:
        bar.close()
    records: dict[str, list[ShardRecord]] = defaultdict(list)
    for split, name, _ in plans:
        records[split].append(done[name])
    return records


def _write_one(
    out: str, split: str, name: str, entries: list[tuple[str, SourceItem, int, int]], resize: int | None
) -> ShardRecord:
    record = ShardRecord(name=name)
    written = []
    for key, item, cls, category in entries:
        try:
            raw = item.data if item.data is not None else _read_file(item)
            data, ext = checked_image(raw, resize)
        except (OSError, ImageError) as exc:
            record.skipped.append({"path": item.path, "split": split, "reason": str(exc)})
            continue
        meta = {"path": item.path, "split": split, "class": item.class_name, "category": item.category}
        meta.update(item.meta)
        written.append(ShardEntry(key, data, ext, cls, category, meta))
        record.class_counts[cls] += 1
        record.category_counts[category] += 1
    record.num_samples = len(written)
    write_shard(os.path.join(out, name), written)
    record.size_bytes = os.path.getsize(os.path.join(out, name))
    return record


def _read_file(item: SourceItem) -> bytes:
    if item.file is None:
        raise ImageError("no file and no data")
    try:
        return item.file.read_bytes()
    except FileNotFoundError as exc:
        raise ImageError("file not found") from exc
    except OSError as exc:
        raise ImageError(f"unreadable: {exc}") from exc


def _load_progress(out: Path, fingerprint: str) -> dict[str, ShardRecord]:
    path = out / PROGRESS_NAME
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except ValueError:
        return {}
    if state.get("fingerprint") != fingerprint:
        return {}
    return {
        name: ShardRecord(
            name=name,
            num_samples=r["num_samples"],
            class_counts=Counter({int(k): v for k, v in r["class_counts"].items()}),
            category_counts=Counter({int(k): v for k, v in r["category_counts"].items()}),
            skipped=r["skipped"],
            size_bytes=r.get("size_bytes"),
        )
        for name, r in state["shards"].items()
    }


def _save_progress(out: Path, fingerprint: str, done: dict[str, ShardRecord]) -> None:
    state: dict[str, Any] = {"fingerprint": fingerprint, "shards": {}}
    for name, r in done.items():
        state["shards"][name] = {
            "num_samples": r.num_samples,
            "class_counts": {str(k): v for k, v in r.class_counts.items()},
            "category_counts": {str(k): v for k, v in r.category_counts.items()},
            "skipped": r.skipped,
            "size_bytes": r.size_bytes,
        }
    tmp = out / f"{PROGRESS_NAME}.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, out / PROGRESS_NAME)


def _build_info(
    source: SourceDataset,
    source_format: str,
    source_desc: str,
    fingerprint: str,
    class_ids: dict[str, int],
    category_ids: dict[str, int],
    records: dict[str, list[ShardRecord]],
) -> DatasetInfo:
    listed: dict[str, set[int]] = defaultdict(set)
    class_category = [-1] * len(class_ids)
    for item in source.items:
        cls = class_ids[item.class_name]
        listed[item.split].add(cls)
        if item.category is not None:
            class_category[cls] = category_ids[item.category]
    splits = {}
    skipped = []
    for split in source.split_order:
        if split not in records:
            continue
        counts: Counter[int] = Counter()
        shards = []
        for r in records[split]:
            counts.update(r.class_counts)
            skipped.extend(SkippedFile(**s) for s in r.skipped)
            shards.append(
                ShardInfo(
                    name=r.name,
                    num_samples=r.num_samples,
                    class_counts=sorted(r.class_counts.items()),
                    category_counts=sorted(r.category_counts.items()) if category_ids else [],
                    size_bytes=r.size_bytes,
                )
            )
        categories = {class_category[c] for c in counts} - {-1}
        splits[split] = SplitInfo(
            num_samples=sum(counts.values()),
            num_classes=len(counts),
            num_categories=len(categories),
            shards=shards,
            singleton_classes=sorted(c for c, n in counts.items() if n == 1),
            empty_classes=sorted(listed[split] - set(counts)),
        )
    # An evaluation of a split that got no image (`--test-fraction 0`, an empty test list) cannot run:
    # left out and said so, not written into a dataset.json that fails on read.
    evaluations, notes = [], list(source.notes)
    for evaluation in source.evaluations:
        missing = [s for s in (evaluation.query, evaluation.gallery) if s is not None and s not in splits]
        if missing:
            notes.append(f"evaluation {evaluation.name!r} left out: split {missing[0]!r} has no images")
        else:
            evaluations.append(evaluation)
    notes += _shared_class_notes(splits, evaluations, sorted(class_ids, key=class_ids.__getitem__))
    return DatasetInfo(
        name=source.name,
        source_format=source_format,
        source=source_desc,
        fingerprint=fingerprint,
        splits=splits,
        class_names=sorted(class_ids, key=class_ids.__getitem__),
        class_to_category=class_category,
        category_names=sorted(category_ids, key=category_ids.__getitem__),
        evaluations=evaluations,
        recall_ks=source.recall_ks,
        sampling_hints=source.sampling_hints,
        skipped=skipped,
        notes=notes,
    )


def _shared_class_notes(
    splits: dict[str, SplitInfo], evaluations: list[Evaluation], class_names: list[str]
) -> list[str]:
    """Classes of the train split that an evaluation also reads: retrieval tests on classes never trained
    on, and a class in both (a folder under train/ and test/, a list's split column) was built silently."""
    if "train" not in splits:
        return []
    trained = {c for shard in splits["train"].shards for c, _ in shard.class_counts}
    notes = []
    for evaluation in evaluations:
        if "train" in (evaluation.query, evaluation.gallery):
            continue
        read = {
            c
            for name in (evaluation.query, evaluation.gallery)
            if name is not None
            for shard in splits[name].shards
            for c, _ in shard.class_counts
        }
        shared = sorted(read & trained)
        if shared:
            shown = ", ".join(class_names[c] for c in shared[:10]) + (" ..." if len(shared) > 10 else "")
            notes.append(
                f"evaluation {evaluation.name!r}: {len(shared)} of its {len(read)} classes are also in train "
                f"(its metrics are not held-out figures for them): {shown}"
            )
    return notes


def _report(info: DatasetInfo, progress: bool) -> None:
    """Say loudly what would otherwise be easy to miss: skipped files, singleton and empty classes, queries
    whose class has no image in their gallery."""
    # A query or gallery split's queries find their positives in the other split: one image of a class
    # there is normal (In-Shop), a query class missing from the gallery is what leaves a query unanswerable.
    paired = {e.query for e in info.evaluations if e.gallery} | {e.gallery for e in info.evaluations}
    paired -= {e.query for e in info.evaluations if not e.gallery} | {"train"}
    for name, split in info.splits.items():
        _say(
            progress,
            f"{name}: {split.num_samples} images, {split.num_classes} classes, "
            f"{split.num_categories} categories, {len(split.shards)} shards",
        )
        if split.singleton_classes and name not in paired:
            shown = ", ".join(info.class_names[c] for c in split.singleton_classes[:10])
            print(
                f"WARNING: {name}: {len(split.singleton_classes)} class(es) have a single image "
                f"(no positive for retrieval; train samplers skip them): {shown}"
                + (" ..." if len(split.singleton_classes) > 10 else ""),
                file=sys.stderr,
            )
        if split.empty_classes:
            shown = ", ".join(info.class_names[c] for c in split.empty_classes[:10])
            print(
                f"WARNING: {name}: {len(split.empty_classes)} class(es) lost every image to skipped files: "
                f"{shown}" + (" ..." if len(split.empty_classes) > 10 else ""),
                file=sys.stderr,
            )
    for evaluation in info.evaluations:
        _report_unanswerable_queries(info, evaluation)
    if info.skipped:
        print(
            f"WARNING: skipped {len(info.skipped)} unreadable image(s); listed in dataset.json 'skipped'",
            file=sys.stderr,
        )
    for note in info.notes:
        print(f"note: {note}", file=sys.stderr)


def _report_unanswerable_queries(info: DatasetInfo, evaluation: Evaluation) -> None:
    """Warn when a query/gallery evaluation has query classes with no gallery image (e.g. after skipped
    files): those queries have no positive and are left out of the metrics."""
    if evaluation.gallery is None or not {evaluation.query, evaluation.gallery} <= set(info.splits):
        return
    query, gallery = info.splits[evaluation.query], info.splits[evaluation.gallery]
    in_gallery = {c for shard in gallery.shards for c, _ in shard.class_counts}
    missing: Counter[int] = Counter()
    for shard in query.shards:
        missing.update({c: n for c, n in shard.class_counts if c not in in_gallery})
    if missing:
        shown = ", ".join(info.class_names[c] for c in sorted(missing)[:10])
        print(
            f"WARNING: {evaluation.name}: {sum(missing.values())} {evaluation.query} image(s) of "
            f"{len(missing)} class(es) have no image of their class in {evaluation.gallery} (no positive: "
            f"left out of the metrics): {shown}" + (" ..." if len(missing) > 10 else ""),
            file=sys.stderr,
        )


def _ours(name: str) -> bool:
    """A file a build writes: dataset.json, shards, the progress record, the lock, their temporary files
    (and `lost+found`, which a fresh volume's root holds)."""
    return (
        name in (METADATA_NAME, PROGRESS_NAME, LOCK_NAME, f"{PROGRESS_NAME}.tmp", "lost+found")
        or name.startswith(f"{METADATA_NAME}.tmp-")
        or bool(_SHARD_RE.match(name))
        or ".tar.tmp-" in name
    )


def _refuse_foreign_folder(out: Path) -> None:
    """A build writes into a new or empty folder, or one holding a build: it replaces shards by name and
    deletes the ones it no longer lists, so a typo'd folder (`/tmp`, a home directory) got 128 shards."""
    if not out.is_dir():
        if out.exists():
            raise NotADirectoryError(f"{out} is a file, not a folder for shards")
        return
    foreign = sorted(p.name for p in out.iterdir() if not (_ours(p.name) or p.name.startswith(".")))
    if foreign:
        raise FileExistsError(
            f"{out} holds files that are not a dmltrain data set ({first_few(foreign, 3)}): prepare into a "
            "new or empty folder"
        )


def _remove_stale(out: Path, keep: set[str]) -> None:
    """Delete shards of an earlier build that the new build no longer lists (only our own file names)."""
    for path in out.iterdir():
        if _SHARD_RE.match(path.name) and path.name not in keep:
            path.unlink()
        elif ".tar.tmp-" in path.name:
            path.unlink(missing_ok=True)


def prepare(
    fmt: str,
    source: str,
    out_dir: str | Path,
    *,
    shard_size: int | None = None,
    group_size: int = 32,
    seed: int = 0,
    resize: int | None = None,
    workers: int = 1,
    force: bool = False,
    progress: bool = True,
    **options: Any,
) -> DatasetInfo:
    """Convert the data set `fmt` at `source` into shards in `out_dir` (what `dmltrain prepare` runs).

    `options` are format specific: test_fraction/seed (folder, csv, glyphs), image_root (csv),
    split_dir (inaturalist), min_faces/image_size/max_classes (glyphs).
    """
    if fmt in ("folder", "csv", "glyphs"):
        options.setdefault("seed", seed)  # the same seed picks held-out classes
    desc = source if fmt == "glyphs" or "://" in source else str(Path(source).expanduser().resolve())
    if fmt == "glyphs":
        desc = glyphs_source_desc(
            **{k: v for k, v in options.items() if v is not None}, shard_size=shard_size
        )
    scan_options = {**options, "workers": workers} if fmt == "glyphs" else options  # glyphs: render too
    return prepare_dataset(
        lambda: scan_source(fmt, source, **scan_options),
        out_dir,
        source_format=fmt,
        source_desc=desc,
        shard_size=shard_size,
        group_size=group_size,
        seed=seed,
        resize=resize,
        workers=workers,
        force=force,
        progress=progress,
    )
