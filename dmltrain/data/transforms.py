"""Image decoding and the papers' augmentations, on uint8 tensors (torchvision.transforms.v2).

Two geometries (`resize_mode`):
- ``"shorter_side"``: train takes a RandomResizedCrop of the original image; test resizes the shorter side
  and takes the centre crop (the aspect ratio is kept).
- ``"warp"``: every image is first warped to ``resize x resize`` (256 x 256 for 224 crops), ignoring its
  aspect ratio, then train takes a RandomResizedCrop of the warped image and test its centre crop: FastAP
  Sec. 5.1, Smooth-AP Sec. 5.3 and RLL Sec. 4.1.2 all do this.
Train crops use scale 0.16-1 (FastAP/Smooth-AP) or 0.5-1 (RLL 4.1.2) with a horizontal flip. Images stay
uint8 so batches are 4x smaller to move between processes; the trainer's `preprocess` turns them into
normalised floats on the device.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

Transform = Callable[[torch.Tensor], torch.Tensor]
ResizeMode = Literal["shorter_side", "warp"]
RESIZE_MODES: tuple[ResizeMode, ...] = ("shorter_side", "warp")


def decode(data: bytes) -> torch.Tensor:
    """Encoded JPEG/PNG/WebP bytes -> uint8 (3, H, W); grey or RGBA sources become RGB.

    PIL rather than torchvision.io, whose decoders are deprecated since torchvision 0.29 (same libjpeg).
    """
    with Image.open(io.BytesIO(data)) as image:
        array = np.array(image.convert("RGB"))
    return torch.from_numpy(array).permute(2, 0, 1)


def default_resize(size: int) -> int:
    """The papers' 256 for 224 crops, scaled to other crop sizes."""
    return round(size * 256 / 224)


def _check_mode(resize_mode: str) -> None:
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {resize_mode!r}")


def train_transform(
    size: int = 224,
    scale: tuple[float, float] = (0.16, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
    *,
    resize_mode: ResizeMode = "shorter_side",
    resize: int | None = None,
) -> Transform:
    """RandomResizedCrop to ``size`` (+ flip) of the original, or of the image warped to ``resize`` squared
    (``resize_mode="warp"``; ``resize`` defaults to `default_resize(size)`)."""
    _check_mode(resize_mode)
    steps: list[Transform] = []
    if resize_mode == "warp":
        side = resize or default_resize(size)
        steps.append(v2.Resize((side, side), antialias=True))
    steps.append(v2.RandomResizedCrop(size, scale=scale, ratio=ratio, antialias=True))
    if flip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps)


def test_transform(
    size: int = 224, resize: int | None = None, resize_mode: ResizeMode = "shorter_side"
) -> Transform:
    """Shorter side to ``resize`` (or, with ``resize_mode="warp"``, the whole image to ``resize`` squared),
    then the centre crop of ``size``; ``resize`` defaults to `default_resize(size)`."""
    _check_mode(resize_mode)
    side = resize or default_resize(size)
    first = v2.Resize((side, side) if resize_mode == "warp" else side, antialias=True)
    return v2.Compose([first, v2.CenterCrop(size)])
