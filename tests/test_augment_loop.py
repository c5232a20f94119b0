"""The CPU loaders' compiled crop loop (`TrainAugment.augment_many`) is `augment` image by image: the same
pixels, and the generator left where torchvision's RandomResizedCrop + RandomHorizontalFlip leave it."""

from __future__ import annotations

import logging

import pytest
import torch
from torchvision.transforms import v2

import dmltrain.data.augment_loop as augment_loop
from dmltrain.data import train_transform

SHAPES = [(3, 40, 30), (1, 64, 64), (3, 300, 500), (3, 17, 200), (1, 24, 24), (3, 90, 25)]  # (3, 17, 200):
# every try misses, the centre-crop fallback


def _images(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, shape, dtype=torch.uint8, generator=g) for shape in SHAPES * 6]


@pytest.mark.parametrize("flip", [True, False])
@pytest.mark.parametrize("scale", [(0.16, 1.0), (1.0, 1.0)])  # (1, 1) on 24 x 24: a crop of size, no resize
def test_augment_many_is_augment_one_by_one_and_torchvisions(flip: bool, scale: tuple[float, float]) -> None:
    augment = train_transform(24, scale=scale, flip=flip)
    flips = [v2.RandomHorizontalFlip()] if flip else []
    reference = v2.Compose([v2.RandomResizedCrop(24, scale=scale, antialias=True), *flips])
    images = _images()
    for seed in range(5):
        torch.manual_seed(seed)
        expected = [reference(image.expand(3, -1, -1)) for image in images]
        after = torch.rand(1)
        torch.manual_seed(seed)
        got = augment.augment_many(images)
        assert torch.rand(1) == after  # the generator advanced exactly as torchvision's
        assert all(torch.equal(a.expand(3, -1, -1), b) for a, b in zip(got, expected, strict=True))
        torch.manual_seed(seed)
        one_by_one = [augment.augment(image) for image in images]
        assert all(torch.equal(a, b) for a, b in zip(got, one_by_one, strict=True))


def test_warp_mode_crops_the_warped_square() -> None:
    augment = train_transform(24, scale=(0.16, 1.0), resize_mode="warp", resize=32)
    prepared = [augment.prepare(image) for image in _images(1)]
    torch.manual_seed(3)
    expected = [augment.augment(image) for image in prepared]
    torch.manual_seed(3)
    assert all(torch.equal(a, b) for a, b in zip(augment.augment_many(prepared), expected, strict=True))


def test_the_python_loop_is_the_compiled_one() -> None:
    args = (_images(2), 24, [0.16, 1.0], [-0.2876821, 0.2876821], [0.75, 4 / 3], 0, True)
    torch.manual_seed(7)
    compiled = augment_loop._scripted()(*args)
    torch.manual_seed(7)
    python = augment_loop.drawn_crops_loop(*args)
    assert all(torch.equal(a, b) for a, b in zip(compiled, python, strict=True))


@pytest.mark.parametrize(
    ("x", "rounded"), [(2.5, 2), (3.5, 4), (-0.5, 0), (2.4999999, 2), (2.5000001, 3), (7.0, 7)]
)
def test_rounding_is_pythons(x: float, rounded: int) -> None:
    assert augment_loop._round(x) == round(x) == rounded


def test_a_failing_compiled_loop_leaves_the_python_one_with_the_same_draws(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> object:
        def run(*args: object) -> list[torch.Tensor]:
            torch.rand(5)  # it had drawn before failing: the generator must be put back
            raise RuntimeError("no TorchScript here\nsecond line")

        return run

    monkeypatch.setattr(augment_loop, "_scripted", broken)
    monkeypatch.setattr(augment_loop, "_SCRIPT_FAILED", [])
    augment = train_transform(24, flip=True)
    images = _images(4)
    torch.manual_seed(11)
    expected = [augment.augment(image) for image in images]
    with caplog.at_level(logging.WARNING, logger="dmltrain.data.augment_loop"):
        for _ in range(2):
            torch.manual_seed(11)
            got = augment.augment_many(images)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert [r.getMessage() for r in caplog.records] == [
        "the compiled crop loop failed (no TorchScript here); cropping in Python from now on"
    ]
