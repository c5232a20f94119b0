"""Streaming readers and batchers on real tar shards: disjoint ranks/workers, equal steps, batch structure,
FastAP category pairs across ranks, exact resume, eval coverage."""

from __future__ import annotations

import csv
import gc
import multiprocessing
import os
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dmltrain.data import EvalLoader, SamplerSpec, TrainLoader, prepare, train_transform
from dmltrain.data import test_transform as eval_transform
from dmltrain.data.metadata import load_dataset_info
from dmltrain.data.plan import check_enough_shards
from dmltrain.data.sampling import split_group
from dmltrain.data.shards import Sample, read_shard

CATEGORIES = 6
CLASSES_PER_CATEGORY = 6
IMAGES_PER_CLASS = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """288 train images (6 categories x 6 classes x 8) plus unlabelled classes and a test split."""
    root = tmp_path_factory.mktemp("stream")
    rows = []
    rng = np.random.default_rng(0)
    for cat in range(CATEGORIES + 1):  # the last "category" is unlabelled (VehicleID-style)
        for k in range(CLASSES_PER_CATEGORY):
            cls = f"c{cat}_{k}"
            for i in range(IMAGES_PER_CLASS):
                rel = f"img/{cls}_{i}.png"
                (root / "img").mkdir(exist_ok=True)
                Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(root / rel)
                split = "test" if k == CLASSES_PER_CATEGORY - 1 else "train"
                rows.append([rel, cls, f"cat{cat}" if cat < CATEGORIES else "", split])
    with (root / "list.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "class", "category", "split"])
        writer.writerows(rows)
    prepare("csv", str(root / "list.csv"), root / "out", shard_size=10, group_size=8, progress=False)
    return root / "out"


def loader(root: Path, name: str, rank: int = 0, world: int = 2, workers: int = 2, batch: int = 16, **kw):
    spec = SamplerSpec(name=name, samples_per_class=4, pool_images=kw.pop("pool", 32), seed=kw.pop("seed", 3))
    return TrainLoader(
        root,
        batch,
        spec,
        rank=rank,
        world_size=world,
        num_workers=workers,
        image_size=16,
        with_keys=True,
        **kw,
    )


def run(train_loader: TrainLoader, steps: int) -> list[tuple]:
    return [train_loader.next_batch() for _ in range(steps)]


def test_ranks_and_workers_read_disjoint_shards_with_equal_steps(shards: Path) -> None:
    loaders = [loader(shards, "pk", rank=r) for r in range(2)]
    assert loaders[0].steps_per_epoch == loaders[1].steps_per_epoch > 0
    member_of = {}  # sample key -> shard index
    info = load_dataset_info(shards)
    for i, url in enumerate(info.shard_urls(shards, "train")):
        member_of.update({s.key: i for s in read_shard(url)})
    seen: dict[tuple[int, int], set[str]] = {}
    for r, train_loader in enumerate(loaders):
        parts = train_loader.plan.parts
        assert parts is not None and sum(parts[2 * r : 2 * r + 2]) == 16 and min(parts) > 0
        batches = list(train_loader)  # one epoch
        assert len(batches) == train_loader.steps_per_epoch
        for images, labels, categories, keys in batches:
            assert images.shape == (16, 3, 16, 16) and images.dtype == torch.uint8
            assert labels.dtype == categories.dtype == torch.int64
            # Every worker of the rank contributed its part, in worker order.
            seen.setdefault((r, 0), set()).update(keys[: parts[2 * r]])
            seen.setdefault((r, 1), set()).update(keys[parts[2 * r] :])
    consumers = list(seen)
    assert len(consumers) == 4
    for i, a in enumerate(consumers):
        for b in consumers[i + 1 :]:
            assert not seen[a] & seen[b], f"consumers {a} and {b} share samples"
    for (r, w), keys in seen.items():  # shard i goes to rank i mod 2, then to the rank's workers in turn
        shards_read = {member_of[k] for k in keys}
        assert shards_read <= set(range(len(member_of)))
        assert {i % 2 for i in shards_read} == {r} and {(i // 2) % 2 for i in shards_read} == {w}


def test_too_few_shards_fails_early_with_a_clear_message(shards: Path) -> None:
    with pytest.raises(ValueError, match="consumers need at least one"):
        loader(shards, "pk", world=8, workers=8)
    check_enough_shards("train", 4, 2, 2)


def test_pk_batches_have_p_classes_of_k(shards: Path) -> None:
    batches = run(loader(shards, "pk", workers=0), 12)
    for _, labels, _, keys in batches:
        assert sorted(Counter(labels.tolist()).values()) == [4, 4, 4, 4]
        assert len(set(keys)) == 16


def test_random_batches_take_whole_classes(shards: Path) -> None:
    for _, labels, _, _ in run(loader(shards, "random", workers=0), 8):
        assert sorted(Counter(labels.tolist()).values()) == [8, 8]


def test_hard_batches_use_the_same_two_categories_on_every_rank(shards: Path) -> None:
    per_rank = [run(loader(shards, "hard", rank=r), 10) for r in range(2)]
    pairs = []
    for step in range(10):
        rank_categories = []
        for r in range(2):
            categories = per_rank[r][step][2].tolist()
            counts = Counter(categories)
            assert len(counts) == 2 and sorted(counts.values()) == [8, 8], counts
            rank_categories.append(set(counts))
        assert rank_categories[0] == rank_categories[1]
        pairs.append(frozenset(rank_categories[0]))
    assert len(set(pairs)) > 1  # the schedule moves through category pairs


def test_vehicleid_batches_pair_one_labelled_category_with_unlabelled_classes(shards: Path) -> None:
    per_rank = [run(loader(shards, "vehicleid", rank=r), 6) for r in range(2)]
    for step in range(6):
        labelled = []
        for r in range(2):
            counts = Counter(per_rank[r][step][2].tolist())
            assert counts[-1] == 8 and len(counts) == 2, counts
            labelled.append(max(counts))
        assert labelled[0] == labelled[1]


def test_triplet_batches(shards: Path) -> None:
    for _, labels, _, _ in run(loader(shards, "triplet", workers=0, batch=15), 6):
        for q, p, n in labels.view(-1, 3).tolist():
            assert q == p != n


@pytest.mark.parametrize(
    "name,workers",
    [("pk", 2), ("hard", 0), ("hard", 2), ("triplet", 0), ("vehicleid", 0), ("random", 0), ("random", 2)],
)
def test_resume_continues_the_stream_exactly(shards: Path, tmp_path: Path, name: str, workers: int) -> None:
    batch = 15 if name == "triplet" else 16
    first = loader(shards, name, workers=workers, batch=batch)
    run(first, 7)
    # Through a file as checkpoints keep it, read back with weights_only=True (plain data only).
    torch.save(first.state_dict(), tmp_path / "stream.pt")
    state = torch.load(tmp_path / "stream.pt", weights_only=True)
    expected = run(first, 6)
    resumed = loader(shards, name, workers=workers, batch=batch)
    resumed.load_state_dict(state)
    got = run(resumed, 6)
    assert [b[3] for b in got] == [b[3] for b in expected]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, expected, strict=True))
    fresh = loader(shards, name, workers=workers, batch=batch)
    assert [b[3] for b in run(fresh, 6)] != [b[3] for b in got]  # it did not restart from the beginning


def _child_processes() -> set[int]:
    mine = str(os.getpid())
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # exited meanwhile
                continue
            if fields[1] == mine:
                children.add(int(entry.name))
    return children


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux-only")
def test_idle_priority_loader_workers_yield_the_cpu_and_give_the_same_batches(shards: Path) -> None:
    before = _child_processes()
    idle = loader(shards, "pk", workers=2, worker_priority="idle")
    got = run(idle, 3)
    workers = _child_processes() - before
    assert len(workers) == 2
    assert {os.sched_getscheduler(pid) for pid in workers} == {os.SCHED_IDLE}
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller keeps its own policy
    expected = run(loader(shards, "pk", workers=2), 3)
    assert [b[3] for b in got] == [b[3] for b in expected]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, expected, strict=True))
    with pytest.raises(ValueError, match="worker_priority"):
        loader(shards, "pk", worker_priority="low")


def test_resume_needs_the_same_layout(shards: Path) -> None:
    state = loader(shards, "pk", workers=0).state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        loader(shards, "pk", workers=0, batch=8).load_state_dict(state)


def test_pk_stream_is_a_pass_over_the_data(shards: Path) -> None:
    """Within a pass hardly anything repeats: the pool reads ahead for classes a part lacks, so a piece of
    the next pass may come before the last of this one (one piece at most here, over several seeds)."""
    train = load_dataset_info(shards).splits["train"].num_samples
    for seed in range(4):
        one = loader(shards, "pk", world=1, workers=0, pool=16, seed=seed)
        assert one.steps_per_epoch == train // 16
        first = [k for b in run(one, (train - 16) // 16) for k in b[3]]
        assert len(first) - len(set(first)) <= 4
        seen = Counter(first + [k for b in run(one, one.steps_per_epoch) for k in b[3]])
        assert len(seen) == train and max(seen.values()) <= 3  # by two epochs every image came, none hogged


def test_eval_covers_the_split_exactly_once(shards: Path) -> None:
    seen: list[str] = []
    for rank in range(2):
        ev = EvalLoader(shards, "test", 5, rank=rank, world_size=2, num_workers=2, image_size=16)
        keys = []
        for images, labels, categories, batch_keys in ev:
            assert images.shape[1:] == (3, 16, 16) and len(labels) == len(categories) == len(batch_keys)
            keys += batch_keys
        assert len(keys) == ev.num_samples == ev.rank_counts[rank]
        seen += keys
    assert len(seen) == len(set(seen)) == (CATEGORIES + 1) * IMAGES_PER_CLASS


def test_a_loader_dropped_without_close_stops_its_thread_and_worker_processes(shards: Path) -> None:
    """With two loader workers the loader joins ahead in a thread, which held the loader itself: a loader
    dropped without close() kept its thread and worker processes as long as the process lived. A closed
    one starts again where it was."""
    children, threads = set(multiprocessing.active_children()), set(threading.enumerate())
    train = loader(shards, "pk", workers=2)
    assert train.joins_ahead
    first = train.next_batch()[3]
    assert len(set(multiprocessing.active_children()) - children) == 2
    train.close()
    again = loader(shards, "pk", workers=2)
    again.next_batch()
    assert again.next_batch()[3] == train.next_batch()[3] != first  # step 2 of both, after a restart
    train.close()
    del train, again
    gc.collect()
    deadline = time.monotonic() + 30
    while set(multiprocessing.active_children()) - children or set(threading.enumerate()) - threads:
        assert time.monotonic() < deadline, (multiprocessing.active_children(), threading.enumerate())
        time.sleep(0.1)


def test_a_capped_eval_reads_the_same_first_images_with_any_number_of_loader_workers(shards: Path) -> None:
    """eval.max_images: the first images of the rank's shards in shard order. Cutting the loader's output
    took the first batches to arrive, which loader workers interleave: another set of images (and other
    metrics) with each data.loader_workers."""
    whole = [k for b in EvalLoader(shards, "test", 5, rank=0, world_size=1, image_size=8) for k in b[3]]
    for cap in (0, 1, 7, len(whole), len(whole) + 3):
        for workers in (0, 1, 3):
            ev = EvalLoader(shards, "test", 5, num_workers=workers, image_size=8, max_images=cap)
            keys = [k for b in ev for k in b[3]]
            assert sorted(keys) == sorted(whole[:cap]) and ev.num_samples == len(keys), (cap, workers)
    with pytest.raises(ValueError, match="max_images"):
        EvalLoader(shards, "test", 5, max_images=-1)


def test_split_group_keeps_every_part_at_least_two() -> None:
    def group(n: int) -> list[Sample]:
        return [Sample(key=str(i), data=b"", cls=0, category=0) for i in range(n)]

    counters: Counter[str] = Counter()
    assert [len(p) for p in split_group(group(9), 4, counters)] == [4, 3, 2]
    assert [len(p) for p in split_group(group(3), 4, counters)] == [3]  # fewer than K: taken whole
    assert split_group(group(1), 4, counters) == [] and counters["skipped_single_images"] == 1
    assert [len(p) for p in split_group(group(5), 2, counters)] == [2, 2]
    assert counters["skipped_single_images"] == 2
    # K = 2: the image of an odd class that waits is drawn anew each pass (it was always the last one,
    # never trained).
    rng = np.random.default_rng(0)
    left_out: set[str] = set()
    for _ in range(50):
        pieces = split_group(group(5), 2, counters, rng)
        assert [len(p) for p in pieces] == [2, 2]
        (missing,) = set("01234") - {s.key for p in pieces for s in p}
        left_out.add(missing)
    assert left_out == set("01234")


def test_transforms_on_uint8() -> None:
    image = torch.randint(0, 256, (3, 40, 30), dtype=torch.uint8)
    out = train_transform(24, scale=(0.5, 1.0))(image)
    assert out.shape == (3, 24, 24) and out.dtype == torch.uint8
    test = eval_transform(24)
    assert torch.equal(test(image), test(image)) and test(image).shape == (3, 24, 24)
