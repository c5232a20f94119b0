"""Image geometry: the papers' warp mode (every image to resize x resize first) against the aspect-keeping
default, for training and test, and its pass-through from the loaders on real shards."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from dmltrain.data import EvalLoader, SamplerSpec, TrainAugment, TrainLoader, prepare, train_transform
from dmltrain.data import test_transform as eval_transform
from dmltrain.data.errors import SampleError
from dmltrain.data.loader import DECODE_BLOCK, collate
from dmltrain.data.shards import Sample
from dmltrain.data.transforms import decode, treats_channels_alike


def banded(height: int = 40, width: int = 80) -> torch.Tensor:
    """Three vertical bands (50 | 150 | 250) over the width: 1/4, 1/2, 1/4 of it."""
    image = torch.full((3, height, width), 150, dtype=torch.uint8)
    image[:, :, : width // 4] = 50
    image[:, :, 3 * width // 4 :] = 250
    return image


def test_warp_test_transform_sees_the_whole_width_the_default_crops_it_away() -> None:
    image = banded()
    kept = eval_transform(24, resize=32)(image)  # shorter side 40 -> 32 (64 wide), centre 24 columns
    warped = eval_transform(24, resize=32, resize_mode="warp")(image)  # 32 x 32, centre 24 columns
    assert kept.shape == warped.shape == (3, 24, 24) and warped.dtype == torch.uint8
    assert set(kept.unique().tolist()) == {150}
    assert warped.min() <= 60 and warped.max() >= 240  # both outer bands survive the warp
    expected = v2.CenterCrop(24)(v2.Resize((32, 32), antialias=True)(image))
    assert torch.equal(warped, expected)
    assert torch.equal(eval_transform(24, resize=32, resize_mode="warp")(image), warped)  # deterministic


def test_warp_train_transform_crops_the_warped_square() -> None:
    image = banded()
    # scale and ratio 1: the crop is the whole warped square, so the result is fully determined
    whole = train_transform(24, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False, resize_mode="warp", resize=32)
    expected = v2.Resize((24, 24), antialias=True)(v2.Resize((32, 32), antialias=True)(image))
    assert torch.equal(whole(image), expected)
    assert whole(image).min() <= 60 and whole(image).max() >= 240

    augment = train_transform(24, scale=(0.5, 1.0), resize_mode="warp")  # resize defaults to 24 x 256/224
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(augment(image))
    assert all(o.shape == (3, 24, 24) and o.dtype == torch.uint8 for o in outs)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_unknown_resize_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="resize_mode must be one of"):
        train_transform(24, resize_mode="stretch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="resize_mode must be one of"):
        eval_transform(24, resize_mode="pad")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def wide_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real shards of wide (16 x 40) PNGs: 4 classes x 4 images for train and test."""
    root = tmp_path_factory.mktemp("wide")
    rng = np.random.default_rng(0)
    rows = []
    (root / "img").mkdir()
    for split in ("train", "test"):
        for c in range(4):
            for i in range(4):
                rel = f"img/{split}{c}_{i}.png"
                Image.fromarray(rng.integers(0, 256, (16, 40, 3), dtype=np.uint8)).save(root / rel)
                rows.append([rel, f"{split}{c}", split])
    with (root / "list.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "class", "split"])
        writer.writerows(rows)
    prepare("csv", str(root / "list.csv"), root / "out", shard_size=8, progress=False)
    return root / "out"


def test_loaders_pass_the_resize_mode_through(wide_shards: Path) -> None:
    evaluated = EvalLoader(wide_shards, "test", 16, image_size=8, resize=12, resize_mode="warp")
    images, _labels, _categories, keys = next(iter(evaluated))
    raw = {}
    for batch in EvalLoader(wide_shards, "test", 16, transform=lambda x: x):
        raw.update(dict(zip(batch[3], batch[0], strict=True)))
    expected = eval_transform(8, 12, "warp")
    for image, key in zip(images, keys, strict=True):
        assert torch.equal(image, expected(raw[key]))
    assert not torch.equal(images[0], eval_transform(8, 12)(raw[keys[0]]))

    spec = SamplerSpec(name="pk", samples_per_class=2, seed=1)
    train = TrainLoader(
        wide_shards, 8, spec, rank=0, world_size=1, num_workers=0, image_size=8, resize_mode="warp", resize=12
    )
    assert isinstance(train.transform, TrainAugment) and train.transform.warp == 12
    batch, _, _ = train.next_batch()
    assert batch.shape == (8, 3, 8, 8)


def test_data_flip_false_never_mirrors_a_training_image(tmp_path: Path) -> None:
    """data.flip: false (glyphs: a mirrored b is a d) reaches the service's training transform."""
    from dmltrain.service.builders import build_train_transform
    from dmltrain.service.config import load_config

    repo = Path(__file__).parents[1]
    image = torch.zeros((3, 32, 32), dtype=torch.uint8)
    image[:, :, :8] = 255  # bright left edge: a mirror puts it on the right
    full_crop = ["data.crop_scale=[1.0, 1.0]", "data.image_size=32"]
    for flip, expect_mirrors in ((False, False), (True, True)):
        config = load_config(repo / "configs" / "quickstart.yaml", [*full_crop, f"data.flip={flip}"])
        transform = build_train_transform(config)
        torch.manual_seed(0)
        mirrored = [bool(transform(image)[:, :, -1].float().mean() > 128) for _ in range(40)]
        assert any(mirrored) is expect_mirrors, (flip, mirrored)


def _png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def test_grey_sources_go_through_one_channel_and_come_out_as_their_rgb_conversion() -> None:
    """The loaders decode a greyscale PNG to one channel for this module's (geometric) transforms and repeat
    it afterwards: pixel for pixel what decoding to RGB first gives, at a third of the pixel work. A user's
    transform, which may treat channels differently, still gets RGB."""
    rng = np.random.default_rng(0)
    grey = [rng.integers(0, 256, (h, w), dtype=np.uint8) for h, w in [(40, 30), (64, 64), (24, 24), (17, 90)]]
    colour = rng.integers(0, 256, (20, 28, 3), dtype=np.uint8)
    samples = [Sample(f"s{i}", _png(a), cls=i, category=0) for i, a in enumerate([*grey, colour])]
    assert decode(samples[0].data, keep_grey=True).shape == (1, 40, 30)
    assert decode(samples[-1].data, keep_grey=True).shape == (3, 20, 28)  # colour sources stay RGB
    transforms = [
        train_transform(24, scale=(0.16, 1.0)),
        train_transform(24, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False),  # 24 x 24: the crop is the image
        train_transform(24, resize_mode="warp", resize=32),
        eval_transform(24, resize=32),
    ]
    for transform in transforms:
        assert treats_channels_alike(transform)
        for seed in range(5):
            torch.manual_seed(seed)
            images, labels, _ = collate(samples, transform)
            torch.manual_seed(seed)
            expected = torch.stack([transform(decode(s.data)) for s in samples])
            assert images.shape == (len(samples), 3, 24, 24) and torch.equal(images, expected)
            assert labels.tolist() == list(range(len(samples)))
    seen: list[tuple[int, ...]] = []

    def user_transform(image: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(image.shape))
        return v2.functional.center_crop(image, [16, 16])

    assert not treats_channels_alike(user_transform)
    assert collate(samples[:1], user_transform)[0].shape == (1, 3, 16, 16) and seen == [(3, 40, 30)]


def test_collate_decodes_in_blocks_and_gives_the_image_by_image_batch() -> None:
    """collate decodes DECODE_BLOCK images, then transforms them (cheaper than alternating): the crops still
    draw the same random numbers in the same order, and a bad image is still named."""
    rng = np.random.default_rng(1)
    count = 2 * DECODE_BLOCK + 5  # three blocks, the last one short
    arrays = [rng.integers(0, 256, (int(rng.integers(20, 50)), 33), dtype=np.uint8) for _ in range(count)]
    samples = [Sample(f"s{i}", _png(a), cls=i, category=0) for i, a in enumerate(arrays)]
    transform = train_transform(16, scale=(0.2, 1.0))
    torch.manual_seed(3)
    images, labels, _ = collate(samples, transform)
    torch.manual_seed(3)
    expected = torch.stack([transform(decode(s.data)) for s in samples])
    assert torch.equal(images, expected) and labels.tolist() == list(range(count))
    broken = [*samples[: DECODE_BLOCK + 2], Sample("bad", b"not an image", cls=0, category=0)]
    with pytest.raises(SampleError, match=r"sample 'bad' .*cannot decode/transform the image"):
        collate(broken, transform)
