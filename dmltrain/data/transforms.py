"""Image decoding and the papers' augmentations, on uint8 tensors (torchvision.transforms.v2).

Train: RandomResizedCrop (scale 0.16-1 as in FastAP/Smooth-AP code, 0.5-1 in RLL) + horizontal flip.
Test: resize + single centre crop. Images stay uint8 so batches are 4x smaller to move between processes;
the trainer's `preprocess` turns them into normalised floats on the device. Sizes and the interpolation
come from the backbone's preprocessing (`dmltrain.models.preprocessing_for`) unless the config overrides.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode, v2

Transform = Callable[[torch.Tensor], torch.Tensor]


def decode(data: bytes) -> torch.Tensor:
    """Encoded JPEG/PNG/WebP bytes -> uint8 (3, H, W); grey or RGBA sources become RGB.

    PIL rather than torchvision.io, whose decoders are deprecated since torchvision 0.29 (same libjpeg).
    """
    with Image.open(io.BytesIO(data)) as image:
        array = np.array(image.convert("RGB"))
    return torch.from_numpy(array).permute(2, 0, 1)


def _mode(interpolation: str) -> InterpolationMode:
    try:
        return InterpolationMode(interpolation)
    except ValueError:
        raise ValueError(
            f"unknown interpolation {interpolation!r}: use bilinear, bicubic or nearest"
        ) from None


def train_transform(
    size: int = 224,
    scale: tuple[float, float] = (0.16, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
    interpolation: str = "bilinear",
) -> Transform:
    steps: list[Transform] = [
        v2.RandomResizedCrop(
            size, scale=scale, ratio=ratio, interpolation=_mode(interpolation), antialias=True
        )
    ]
    if flip:
        steps.append(v2.RandomHorizontalFlip())
    return v2.Compose(steps)


def test_transform(
    size: int = 224, resize: int | None = None, interpolation: str = "bilinear", crop_mode: str = "center"
) -> Transform:
    """Shorter side to `resize` (default size x 256/224, the papers' 256 for 224 crops), centre crop.

    ``crop_mode="squash"`` resizes both sides to `resize` (aspect ratio not kept) before the crop, as some
    timm and open_clip models were evaluated.
    """
    resize = resize or round(size * 256 / 224)
    target: int | list[int] = [resize, resize] if crop_mode == "squash" else resize
    return v2.Compose(
        [v2.Resize(target, interpolation=_mode(interpolation), antialias=True), v2.CenterCrop(size)]
    )
