"""Batches from all the data a rank has: every loader worker fills a part of every local batch, so a global
batch forms whenever the classes allow it (B/K <= train classes) at any ranks x loader workers; infeasible
batches are refused from dataset.json before any process starts; hard batches take whole classes and
VehicleID keeps every model. Real shards written by the project's own prepare path."""

from __future__ import annotations

import io
import itertools
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dmltrain.data import SamplerSpec, TrainLoader, load_dataset_info
from dmltrain.data.conversion import prepare_dataset
from dmltrain.data.datasets.base import SourceDataset, SourceItem
from dmltrain.data.fill import Fill, repair, subset_sum, take_greedy
from dmltrain.data.metadata import Evaluation
from dmltrain.data.plan import BatchError, TrainPlan, apportion, check_batch, phase
from dmltrain.data.sampling import PoolBatcher, largest_piece, split_group
from dmltrain.data.shards import Sample
from dmltrain.data.stream import GroupStream


def _png(rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def synthetic(
    root: Path, classes: list[tuple[str, int, str | None]], shard_size: int, group_size: int = 8
) -> Path:
    """Shards of tiny PNGs: (class, images, category) train classes plus a 4-class test split."""
    rng = np.random.default_rng(0)
    items = [
        SourceItem("train", name, f"{name}/{i}.png", data=_png(rng), category=category)
        for name, n, category in classes
        for i in range(n)
    ]
    items += [
        SourceItem("test", f"t{c}", f"t{c}/{i}.png", data=_png(rng)) for c in range(4) for i in range(3)
    ]
    source = SourceDataset("synthetic", items, [Evaluation(name="test", query="test")], ["train", "test"])
    prepare_dataset(
        lambda: source,
        root,
        source_format="synthetic",
        source_desc="tests",
        shard_size=shard_size,
        group_size=group_size,
        progress=False,
    )
    return root


@pytest.fixture(scope="module")
def forty(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 train classes of exactly 4 images in 20 shards: each rank holds 10 shards = 20 classes."""
    root = tmp_path_factory.mktemp("forty")
    return synthetic(root, [(f"c{i:02d}", 4, None) for i in range(40)], shard_size=8, group_size=4)


@pytest.fixture(scope="module")
def categories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 categories of classes with 2-7 images (5 of 30 classes, one of a single class, so on one shard
    only), plus 80 unlabelled classes (category -1, VehicleID style): about 1,100 images in 28 shards."""
    rng = np.random.default_rng(1)
    classes: list[tuple[str, int, str | None]] = []
    for cat in range(6):
        for k in range(1 if cat == 5 else 30):
            classes.append((f"m{cat}_{k}", int(rng.integers(2, 8)), f"model{cat}"))
    classes += [(f"u{k}", int(rng.integers(2, 8)), None) for k in range(80)]
    return synthetic(tmp_path_factory.mktemp("categories"), classes, shard_size=40, group_size=8)


def loaders(root: Path, name: str, batch: int, world: int, workers: int, k: int = 4) -> list[TrainLoader]:
    spec = SamplerSpec(name=name, samples_per_class=k, seed=5)
    return [
        TrainLoader(
            root, batch, spec, rank=r, world_size=world, num_workers=workers, image_size=8, with_keys=True
        )
        for r in range(world)
    ]


def global_batches(ranks: list[TrainLoader], steps: int) -> list[tuple[torch.Tensor, list[str], bytes]]:
    """(labels, keys, image bytes) of each global batch: every rank's local batch, in rank order."""
    out = []
    for _ in range(steps):
        batches = [r.next_batch() for r in ranks]
        labels = torch.cat([b[1] for b in batches])
        keys = [k for b in batches for k in b[3]]
        out.append((labels, keys, b"".join(b[0].numpy().tobytes() for b in batches)))
    return out


def test_every_class_forms_each_global_batch_at_b_over_k_equal_to_the_classes(forty: Path) -> None:
    """B/K = 40 = train classes over 2 ranks x 3 loader workers: every class in every global batch. The
    old design built each local batch in one worker from its own classes, at most 8 here."""
    ranks = loaders(forty, "pk", batch=80, world=2, workers=3)
    plan = ranks[0].plan
    assert max(h.classes for h in plan.holdings) * 4 < 80  # no single worker could fill a local batch
    assert [sum(plan.parts[3 * r : 3 * r + 3]) for r in range(2)] == [80, 80]  # type: ignore[index]
    first = global_batches(ranks, 5)
    for labels, keys, _ in first:
        assert Counter(labels.tolist()) == {c: 4 for c in range(40)}
        assert len(set(keys)) == 160

    # Same seed and layout: the same batches, images included, whatever the timing of the workers.
    again = loaders(forty, "pk", batch=80, world=2, workers=3)
    assert [(b[1], b[2]) for b in global_batches(again, 5)] == [(b[1], b[2]) for b in first]

    # Resume mid-stream (the saved loaders had prefetched ahead): the following batches are identical.
    saved = loaders(forty, "pk", batch=80, world=2, workers=3)
    global_batches(saved, 2)
    states = [r.state_dict() for r in saved]
    assert all(s["step"] == 2 for s in states)
    resumed = loaders(forty, "pk", batch=80, world=2, workers=3)
    for r, state in zip(resumed, states, strict=True):
        r.load_state_dict(state)
    assert [(b[1], b[2]) for b in global_batches(resumed, 3)] == [(b[1], b[2]) for b in first[2:]]


def test_infeasible_batches_are_refused_from_dataset_json_in_one_line(forty: Path, categories: Path) -> None:
    info = load_dataset_info(forty)

    def refused(root: Path, sampler: dict, batch: int, world: int = 2, workers: int = 3) -> str:
        with pytest.raises(BatchError) as error:
            check_batch(load_dataset_info(root), "train", sampler, batch, world, workers, where=str(root))
        assert "\n" not in str(error.value)
        return str(error.value)

    assert refused(forty, {"name": "pk", "samples_per_class": 4}, 164) == (
        f"train.global_batch_size=164 / sampler.samples_per_class=4 = 41 classes per batch, but {forty} "
        f"has 40 train classes (of 2+ images)"
    )
    # 168 / 8 = 21 classes of 40, but classes have 4 images: each rank's 20 classes give at most 80.
    message = refused(forty, {"name": "pk", "samples_per_class": 8}, 168)
    assert "is 84 images per rank" in message and "20 train classes giving at most 80" in message
    assert message.endswith("lower train.global_batch_size to 160 or less")
    assert "not a multiple of 3" in refused(forty, {"name": "triplet"}, 160)
    assert "needs category labels" in refused(forty, {"name": "hard"}, 16)
    assert "consumers need at least one" in refused(forty, {"name": "pk"}, 16, world=4, workers=6)
    assert "from each of two categories" in refused(categories, {"name": "hard"}, 400, workers=2)
    assert "from unlabelled vehicles" in refused(categories, {"name": "vehicleid"}, 800, workers=2)
    # The largest feasible batch is accepted, at any number of loader workers.
    for workers in (1, 2, 3, 5):
        assert check_batch(info, "train", {"name": "pk"}, 160, 2, workers).parts is not None


def _two_ranks_of_three_loaders(root: Path) -> list[str]:
    """The quickstart on `root` with 2 ranks x 3 loader workers (1 CPU each, so 2 cores hold them)."""
    return [
        f"data.root={root}",
        "data.prepare=null",
        "scaling.num_workers=2",
        "scaling.cpus_per_worker=1",
        "data.loader_workers=3",
    ]


def test_prepare_data_refuses_an_infeasible_batch_before_ray(forty: Path) -> None:
    from dmltrain.service.config import ConfigError, load_config
    from dmltrain.service.run import prepare_data

    repo = Path(__file__).resolve().parents[1]
    overrides = _two_ranks_of_three_loaders(forty)
    ok = load_config(repo / "configs" / "quickstart.yaml", [*overrides, "train.global_batch_size=160"])
    prepare_data(ok)
    bad = load_config(repo / "configs" / "quickstart.yaml", [*overrides, "train.global_batch_size=200"])
    with pytest.raises(ConfigError) as error:
        prepare_data(bad)
    assert str(error.value) == bad_message(forty)


@pytest.mark.service
def test_the_driver_refuses_an_infeasible_batch_in_one_line_without_ray(forty: Path, tmp_path: Path) -> None:
    """`python -m dmltrain.run` on this machine: exit status 2 and one line, before a local Ray instance
    starts (without RAY_ADDRESS the driver checks the data before it starts Ray)."""
    repo = Path(__file__).resolve().parents[1]
    overrides = _two_ranks_of_three_loaders(forty)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dmltrain.run",
            "configs/quickstart.yaml",
            *overrides,
            "train.global_batch_size=200",
            f"run.storage_path={tmp_path}",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        ],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"},
    )
    assert proc.returncode == 2, proc.stderr
    # Ray's own lines when it starts or joins one (the driver's "Ray cluster: single node" is its plan).
    assert "local Ray instance" not in proc.stderr and "existing Ray cluster" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {bad_message(forty)}"], proc.stderr


def bad_message(root: Path) -> str:
    return (
        f"train.global_batch_size=200 / sampler.samples_per_class=4 = 50 classes per batch, but {root} has "
        f"40 train classes (of 2+ images)"
    )


def _counter(ranks: list[TrainLoader], name: str) -> int:
    """A batcher counter summed over every worker of every rank (it travels in the loader state)."""
    return sum(
        w["batcher"]["counters"].get(name, 0) for r in ranks for w in r.state_dict()["workers"].values()
    )


def test_hard_batches_take_whole_classes_in_half_and_half(categories: Path) -> None:
    """FastAP supplement A: a sampled class enters the batch whole; half the batch from each category."""
    info = load_dataset_info(categories)
    sizes = Counter(c for s in info.split("train").shards for c, n in s.class_counts for _ in range(n))
    ranks = loaders(categories, "hard", batch=48, world=2, workers=2)
    plan = ranks[0].plan
    cut = 0
    for step, (labels, _, _) in enumerate(global_batches(ranks, 10)):
        cut += sum(1 for c, n in Counter(labels.tolist()).items() if n != sizes[c])
        halves = Counter(info.class_to_category[c] for c in labels.tolist())
        a, b = plan.schedule.at(step)  # type: ignore[union-attr]
        assert set(halves) == {a, b}
        assert abs(halves[a] - plan._pair_total(a, b)) <= 6, halves  # half, to whole-class granularity
    assert cut == _counter(ranks, "cut_classes") <= 2  # a class is cut only when no exchange fills a part
    assert _counter(ranks, "off_plan_images") == _counter(ranks, "repeated_images") == 0


def test_vehicleid_serves_every_model_even_one_held_by_a_single_worker(categories: Path) -> None:
    info = load_dataset_info(categories)
    ranks = loaders(categories, "vehicleid", batch=48, world=2, workers=2)
    plan = ranks[0].plan
    single = info.category_names.index("model5")  # one class: on one shard, so one of the 4 workers
    assert sum(1 for h in plan.holdings if h.whole.get(single)) == 1
    assert plan.excluded_categories == []
    schedule = plan.schedule
    assert schedule is not None and {schedule.at(s)[0] for s in range(schedule.round_length)} == set(range(6))
    steps = schedule.round_length
    seen = set()
    for step, (labels, _, _) in enumerate(global_batches(ranks, steps)):
        model = schedule.at(step)[0]
        cats = Counter(info.class_to_category[c] for c in labels.tolist())
        assert set(cats) == {model, -1} and len(labels) == 96
        if plan.totals[model] < 48:  # a model smaller than half a batch gives all it has
            assert cats[model] == plan.totals[model]
        else:  # else half the batch, to whole-class granularity
            assert abs(cats[model] - 48) <= 6
        seen.add(model)
    assert seen == set(range(6))


@pytest.mark.parametrize("name", ["hard", "triplet"])
def test_parts_resume_exactly(categories: Path, name: str) -> None:
    batch = 12
    first = loaders(categories, name, batch=batch, world=2, workers=2)
    global_batches(first, 3)
    states = [r.state_dict() for r in first]
    expected = global_batches(first, 3)
    again = loaders(categories, name, batch=batch, world=2, workers=2)
    for r, state in zip(again, states, strict=True):
        r.load_state_dict(state)
    assert [(b[1], b[2]) for b in global_batches(again, 3)] == [(b[1], b[2]) for b in expected]


def test_apportion_is_exact_capped_and_fair_over_steps() -> None:
    rng = np.random.default_rng(0)
    for _ in range(2000):
        n = int(rng.integers(1, 7))
        caps = [int(c) for c in rng.integers(0, 30, n)]
        weights = [int(w) for w in rng.integers(0, 10, n)]
        total = int(rng.integers(0, sum(caps) + 1))
        unit = int(rng.choice([1, 2, 3, 4]))
        parts = apportion(total, weights, caps, unit, phase(int(rng.integers(1 << 20))))
        assert sum(parts) == total and all(0 <= p <= c for p, c in zip(parts, caps, strict=True))
    assert apportion(80, [32, 24, 24], [32, 24, 24], 4) == [32, 24, 24]
    # 8 images (one class of 8) over workers holding 24 and 16: 4.8 and 3.2 on average, never 8 and 0 always.
    mean = np.mean([apportion(8, [24, 16], [24, 16], 8, phase(s)) for s in range(1000)], axis=0)
    assert np.allclose(mean, [4.8, 3.2], atol=0.05)
    with pytest.raises(ValueError, match="cannot place"):
        apportion(7, [5, 1], [5, 1])


def test_whole_items_fill_exactly_by_exchange() -> None:
    assert subset_sum([5, 3, 4, 2], 6) == [2, 3]
    assert subset_sum([5, 5], 3) is None
    # Greedy takes 4 + 4 of a part of 10 and cannot place the 3s (a single image would remain): giving
    # one 4 back and adding 3 + 3 fills it with whole classes.
    fill = Fill(10)
    items = [("a", 1, 4), ("b", 2, 4), ("c", 3, 3), ("d", 4, 3)]
    take_greedy(items, fill, 10)
    assert fill.need == 2
    assert repair(fill, items) and fill.need == 0
    assert sorted(size for _, _, size in fill.taken) == [3, 3, 4]


def test_largest_piece_matches_split_group() -> None:
    for k in (2, 3, 4, 5, None):
        for n in range(1, 30):
            group = [Sample(key=str(i), data=b"", cls=0, category=0) for i in range(n)]
            pieces = split_group(group, k, Counter())
            assert largest_piece(n, k) == max((len(p) for p in pieces), default=0), (n, k)


def test_plan_is_the_same_in_every_process(categories: Path) -> None:
    """Quotas are a pure function of (dataset.json, layout, seed, step): two plans agree, and every
    rank's parts of a step add up to its local batch."""
    info = load_dataset_info(categories)
    spec = SamplerSpec(name="vehicleid", seed=2)
    one, two = (TrainPlan(info, "train", spec, 12, 2, 2) for _ in range(2))
    for step in range(40):
        quotas = [one.quota(step, c) for c in range(4)]
        assert quotas == [two.quota(step, c) for c in range(4)]
        for r in range(2):
            assert sum(n for q in quotas[2 * r : 2 * r + 2] for _, n in q) == 12


def _pool_batcher(
    root: Path, spec: SamplerSpec, part: int, turns: dict[int, tuple[int, int, int]] | None = None
) -> PoolBatcher:
    """This process's one consumer's pool batcher, built as the loader builds it, without decoding."""
    info = load_dataset_info(root)
    plan = TrainPlan(info, "train", spec, part, 1, 1)
    held = plan.holdings[0]
    urls = info.shard_urls(root, "train")
    stream = GroupStream(urls, held.shards, spec.seed, 0, plan.shard_samples, None, plan.shard_classes)
    return PoolBatcher(
        stream, plan.parts[0], spec, 1, "worker 0", held.classes, held.images, plan.capacity[0], turns
    )


def test_a_part_takes_another_holder_s_turn_only_for_what_it_lacks(tmp_path: Path) -> None:
    """Short of classes on its turn, a part refilled from all classes in random order: of 200 such parts
    that needed one class off its turn, 196 took two to four (each may then be in the batch twice)."""
    root = synthetic(tmp_path / "pairs", [(f"c{i}", 2, None) for i in range(10)], shard_size=100)
    off_turn = {c: (1, 2, 0) for c in range(7)}  # at even steps another holder's: 3 classes, 6 images left
    for seed in range(20):
        spec = SamplerSpec(name="pk", samples_per_class=2, seed=seed)
        batcher = _pool_batcher(root, spec, 8, off_turn)
        batch = batcher.next_batch(0)
        assert len(batch) == 8 and {s.cls for s in batch} >= {7, 8, 9}
        assert batcher.counters["off_turn_classes"] == 1


def test_pk_pieces_of_a_class_change_from_pass_to_pass(tmp_path: Path) -> None:
    """A class group is stored in one order: cut as stored, a class of 8 gave the same two pieces of 4 on
    every pass, so only 12 of its 28 positive pairs ever met in a batch, however long the run."""
    root = synthetic(tmp_path / "eight", [(f"c{i:02d}", 8, None) for i in range(20)], 40, group_size=8)
    batcher = _pool_batcher(root, SamplerSpec(name="pk", samples_per_class=4, seed=0), 16)
    pairs: dict[int, set[tuple[int, int]]] = {}
    for step in range(100):  # 10 passes
        batch = batcher.next_batch(step)
        by_class: dict[int, list[int]] = {}
        for sample in batch:
            by_class.setdefault(sample.cls, []).append(sample.member)
        assert len(batch) == 16 and all(len(members) == 4 for members in by_class.values())
        for cls, members in by_class.items():
            pairs.setdefault(cls, set()).update(itertools.combinations(sorted(members), 2))
    assert len(pairs) == 20 and min(len(p) for p in pairs.values()) >= 20  # of 28; 12 with fixed pieces


def _largest_pool(batcher: PoolBatcher, steps: int) -> int:
    """The most images ``batcher`` held over ``steps`` parts of 8 (each checked: 8 images, K=4 a class)."""
    largest = 0
    for step in range(steps):
        batch = batcher.next_batch(step)
        assert len(batch) == 8 and max(Counter(s.cls for s in batch).values()) <= 4
        largest = max(largest, batcher.size)
    return largest


def test_pk_pool_stays_bounded_when_one_class_is_most_of_the_data(tmp_path: Path) -> None:
    """Reading past a full pool for the classes a part lacks kept every piece of the classes it had: one
    class of 200 among 20 of 4 grew a pool of 64 images to 13,757 by step 2,000 (a part takes one piece
    per class). Its surplus now waits for the next pass, counted."""
    classes = [("big", 200, None)] + [(f"s{i:02d}", 4, None) for i in range(20)]
    root = synthetic(tmp_path / "skewed", classes, shard_size=10_000, group_size=32)
    batcher = _pool_batcher(root, SamplerSpec(name="pk", samples_per_class=4, pool_images=64, seed=0), 8)
    largest = _largest_pool(batcher, 600)
    # past the limit: groups of classes the pool lacks, and a pass read when a part comes up short
    assert largest <= 2 * batcher.most_images  # 183 of 128 measured; about 4,000 by step 600 before
    assert batcher.counters["pool_overflow_images"] > 0


def test_pk_pool_stays_bounded_when_parts_come_up_short(tmp_path: Path) -> None:
    """Small classes of 2-7 images cut at K=4 often do not add up to a part; each short part read a pass
    with no bound, and one common class's pieces piled up again (20,253 images held at step 800 here, the
    worker holding 520). A pass of steps takes at most one piece of a class a step: more are not kept."""
    sizes = [444, 5, 2, 2, 4, 5, 3, 3, 2, 7, 5, 3, 6, 7, 3, 7, 6, 6]
    classes = [(f"c{i:02d}", n, None) for i, n in enumerate(sizes)]
    root = synthetic(tmp_path / "short", classes, shard_size=180, group_size=28)
    batcher = _pool_batcher(root, SamplerSpec(name="pk", samples_per_class=4, pool_images=16, seed=0), 8)
    largest = _largest_pool(batcher, 800)
    assert largest <= batcher.pass_images  # 351 measured: within one pass of this worker's data


def test_pk_part_near_the_plans_capacity_takes_each_class_s_largest_piece(tmp_path: Path) -> None:
    """The plan counts each class's largest piece (a class of 5 at K=4 gives 3 + 2); the batcher offered
    whichever piece came first, so batches the plan accepted (156 of 162 here) failed at step 0, with advice
    to raise sampler.pool_images when the pool already held every class."""
    rng = np.random.default_rng(0)
    classes = [(f"c{i:02d}", int(rng.integers(2, 10)), None) for i in range(48)]
    root = synthetic(tmp_path / "margin", classes, shard_size=24, group_size=16)
    spec = SamplerSpec(name="pk", samples_per_class=4, seed=1)
    batcher = _pool_batcher(root, spec, 156)
    for step in range(30):
        batch = batcher.next_batch(step)
        assert len(batch) == 156 and max(Counter(s.cls for s in batch).values()) <= 4


def test_a_class_dealt_over_several_consumers_is_in_a_global_batch_once(tmp_path: Path) -> None:
    """`prepare` deals a class larger than its group size over several shards, so several loader workers
    and ranks hold it; each filled its part from its own classes, and a P x K batch held such a class two or
    three times (2K-3K images: every step here, 35 of 50 on a CUB-like layout). The holders now take turns.
    Real loaders: 2 ranks x 2 loader processes."""
    root = synthetic(tmp_path / "split", [(f"c{i:02d}", 16, None) for i in range(12)], 32, group_size=4)
    spec = SamplerSpec(name="pk", samples_per_class=4, seed=1)
    with pytest.warns(UserWarning, match="1 train classes are held only by loader workers whose part"):
        TrainLoader(root, 8, spec, rank=0, world_size=2, num_workers=2, image_size=8)  # parts [8, 0, 8, 0]
    ranks = [
        TrainLoader(root, 16, spec, rank=r, world_size=2, num_workers=2, image_size=8, with_keys=True)
        for r in range(2)
    ]
    assert ranks[0].plan.holders and all(ranks[0].plan.parts)  # the classes really are shared
    try:
        seen: set[int] = set()
        for _ in range(24):
            batches = [loader.next_batch() for loader in ranks]
            labels = Counter(int(y) for _, y, _, _ in batches for y in y.tolist())
            assert sorted(labels.values()) == [4] * 8, labels
            seen.update(labels)
        assert len(seen) == 12  # no class is left out by the turns
        # no part needed another consumer's turn (the service logs these counters as sampler/*)
        assert all(
            TrainLoader.sampler_counters(r.state_dict()).get("off_turn_classes", 0) == 0 for r in ranks
        )
    finally:
        for loader in ranks:
            loader.close()


def test_hard_quotas_give_no_loader_worker_a_single_image(categories: Path) -> None:
    """Two ranks' workers each got one image of a category (a rank's share of 2 split 1 + 1): a part of one
    image has no class to fill it, and the run the plan accepted stopped at step 0 with 'no class of 2+
    images of categories [4] is buffered' (3 ranks x 2 loader workers, B=24)."""
    spec = SamplerSpec(name="hard", seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the layout's small-category warnings
        plan = check_batch(load_dataset_info(categories), "train", spec, 24, 3, 2)
        loader = TrainLoader(
            categories, 8, spec, rank=2, world_size=3, num_workers=2, image_size=8, with_keys=True
        )
    for step in range(plan.steps_per_epoch):
        for consumer in range(plan.consumers):
            quota = plan.quota(step, consumer)
            assert sum(n for _, n in quota) != 1, (step, consumer, quota)
    try:
        for _ in range(12):
            keys = loader.next_batch()[3]
            assert len(keys) == len(set(keys)) == 8
    finally:
        loader.close()
