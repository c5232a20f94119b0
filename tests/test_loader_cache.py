"""The training loader's shard cache (`dmltrain.data.cache`) on real tar shards: the same batches as
without it, no shard read and no image decoded twice once a pass is done, off when the shards do not fit."""

from __future__ import annotations

import csv
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import dmltrain.data.loader as loader_module
from dmltrain.data import SamplerSpec, TrainLoader, prepare, train_transform
from dmltrain.data.cache import PROJECT_AFTER, ShardCache
from dmltrain.data.metadata import load_dataset_info
from dmltrain.data.shards import Sample, ShardError


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """192 train images (4 categories x 4 classes x 12, 24 x 20 px, some grey) in shards of 10."""
    root = tmp_path_factory.mktemp("cache")
    (root / "img").mkdir()
    rows = []
    rng = np.random.default_rng(0)
    for cat in range(4):
        for k in range(4):
            for i in range(12):
                rel = f"img/c{cat}_{k}_{i}.png"
                shape = (24, 20) if i % 3 == 0 else (24, 20, 3)
                Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(root / rel)
                rows.append([rel, f"c{cat}_{k}", f"cat{cat}", "train"])
    with (root / "list.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "class", "category", "split"])
        writer.writerows(rows)
    prepare("csv", str(root / "list.csv"), root / "out", shard_size=10, group_size=12, progress=False)
    return root / "out"


def make(root: Path, name: str = "pk", *, workers: int = 2, cache_mb: int = 0, **crop) -> TrainLoader:
    spec = SamplerSpec(name=name, samples_per_class=4, pool_images=32, seed=5)
    batch = 15 if name == "triplet" else 16
    return TrainLoader(
        root,
        batch,
        spec,
        rank=0,
        world_size=1,
        num_workers=workers,
        transform=train_transform(16, scale=(0.3, 1.0), **crop),
        with_keys=True,
        cache_mb=cache_mb,
    )


def batches(loader: TrainLoader, steps: int) -> list[tuple]:
    return [loader.next_batch() for _ in range(steps)]


def assert_same(got: list[tuple], expected: list[tuple]) -> None:
    assert [b[3] for b in got] == [b[3] for b in expected]
    for a, b in zip(got, expected, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True))


@pytest.mark.parametrize(
    "name,workers,crop",
    [
        ("pk", 2, {}),
        ("pk", 0, {"resize_mode": "warp", "resize": 20}),
        ("hard", 2, {}),
        ("triplet", 0, {}),
    ],
)
def test_the_same_batches_with_and_without_the_cache(
    shards: Path, name: str, workers: int, crop: dict
) -> None:
    steps = 3 * make(shards, name, workers=0).steps_per_epoch  # three passes: cached from the second on
    cached = batches(make(shards, name, workers=workers, cache_mb=8, **crop), steps)
    assert_same(cached, batches(make(shards, name, workers=workers, **crop), steps))


def test_after_the_first_pass_no_shard_is_read(shards: Path, tmp_path: Path) -> None:
    copy = tmp_path / "data"
    shutil.copytree(shards, copy)
    steps = make(copy).steps_per_epoch
    expected = batches(make(shards), 5 * steps)
    for cache_mb in (8, 0):
        loader = make(copy, cache_mb=cache_mb)
        first = batches(loader, 2 * steps)
        for shard in copy.glob("train-*.tar"):
            shard.unlink()  # the worker processes keep running: only what they hold can serve them now
        if cache_mb:
            assert_same(first + batches(loader, 3 * steps), expected)
        else:
            with pytest.raises(ShardError, match="train-"):
                batches(loader, 3 * steps)
        shutil.rmtree(copy)
        shutil.copytree(shards, copy)


def test_each_image_is_decoded_once(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    original = loader_module.decode

    def counting(data: bytes, keep_grey: bool = False) -> torch.Tensor:
        decoded.append(1)
        return original(data, keep_grey)

    monkeypatch.setattr(loader_module, "decode", counting)
    images = load_dataset_info(shards).splits["train"].num_samples
    for cache_mb in (8, 0):
        decoded.clear()
        loader = make(shards, workers=0, cache_mb=cache_mb)  # in this process, where the count is kept
        steps = 4 * loader.steps_per_epoch
        batches(loader, steps)
        if cache_mb:
            assert 0.8 * images <= len(decoded) <= images  # each at most once (the last pass may leave a few)
        else:
            assert len(decoded) == steps * loader.batch_size


def sample(shard: int, member: int, size: int = 100) -> Sample:
    return Sample(key=f"s{shard}_{member}", data=bytes(size), cls=0, category=0, shard=shard, member=member)


def test_the_cache_turns_itself_off_when_the_shards_do_not_fit(caplog: pytest.LogCaptureFixture) -> None:
    image = torch.zeros(3, 10, 10, dtype=torch.uint8)  # 300 bytes
    fits = ShardCache(budget_bytes=10_000, expected_images=PROJECT_AFTER, where="rank 0 worker 0")
    fits.keep_shard(0, [sample(0, 0), sample(0, 1)])
    fits.keep_image(sample(0, 0), image)
    assert fits.enabled and fits.shard(0) is not None and fits.image(sample(0, 0)) is image
    assert fits.image(sample(0, 1)) is None and fits.shard(1) is None

    fits.keep_shard(1, [sample(1, m, size=9_000) for m in range(2)])  # outgrows the budget
    assert not fits.enabled and fits.used_bytes == 0
    assert fits.shard(0) is None and fits.image(sample(0, 0)) is None
    fits.keep_shard(2, [sample(2, 0)])  # and stays off
    assert fits.shard(2) is None

    # Within the budget so far, but the first images say the worker's share will not fit: off early.
    budget = PROJECT_AFTER * 300 * 2
    caplog.set_level(logging.INFO, logger="dmltrain.data.cache")
    projected = ShardCache(budget_bytes=budget, expected_images=PROJECT_AFTER * 3, where="rank 1 worker 2")
    for member in range(PROJECT_AFTER - 1):
        projected.keep_image(sample(0, member), image.clone())
    assert projected.enabled
    projected.keep_image(sample(0, PROJECT_AFTER), image.clone())
    assert not projected.enabled and projected.image(sample(0, 0)) is None
    assert "rank 1 worker 2" in caplog.text and "data.cache_mb" in caplog.text

    # Decoding on the GPU keeps no decoded image: the shards read so far project alone.
    encoded = ShardCache(budget_bytes=200_000, expected_images=PROJECT_AFTER * 10)
    for shard in range(PROJECT_AFTER // 16 - 1):
        encoded.keep_shard(shard, [sample(shard, m) for m in range(16)])
    assert encoded.enabled and encoded.used_bytes < 200_000
    encoded.keep_shard(99, [sample(99, m) for m in range(16)])  # 256 samples of 400 bytes: 1 MB for all
    assert not encoded.enabled and encoded.shard(0) is None
    with pytest.raises(ValueError, match="cache_mb"):
        TrainLoader("unused", 16, cache_mb=-1, info=None)
