"""The CPU loaders' random crops in one compiled loop: draw, crop, resize and flip a list of images.

Why: at the quickstart's scale (32 px crops of 64 px glyphs) the Python around each image's draws and resize
weighs more than the resize itself: compiled, a loader with a full shard cache spends 6.5 instead of 9.9 ms
of a core on a batch of 128; on 2 cores the training step pays a loader's CPU time about once over,
whatever its priority. The loop makes the same generator calls in the same order as `TrainAugment.draw`
(torchvision's RandomResizedCrop, then RandomHorizontalFlip's coin, image by image) and the same resize as
its native CPU path (uint8 bilinear with antialiasing), so a seed gives the same pixels and leaves the
generator where the Python loop leaves it. `python bench/loader_cpu.py` measures it.

No ``from __future__ import annotations`` here: TorchScript reads these annotations.
"""

import functools
import logging
import math
import warnings
from collections.abc import Callable

import torch
from torch.nn import functional as nn_functional

from dmltrain.data.errors import first_line

log = logging.getLogger(__name__)

DrawnCrops = Callable[
    [list[torch.Tensor], int, list[float], list[float], list[float], int, bool], list[torch.Tensor]
]


def _round(x: float) -> int:
    """Python's ``round`` of a float (the nearest integer, ties to the even one), spelled out so that the
    compiled loop rounds exactly as `TrainAugment.draw` does."""
    low = math.floor(x)
    rest = x - low
    if rest > 0.5 or (rest == 0.5 and low % 2 == 1):
        return int(low) + 1
    return int(low)


def drawn_crops_loop(
    images: list[torch.Tensor],
    size: int,
    scale: list[float],
    log_ratio: list[float],
    ratio: list[float],
    warp: int,
    flip: bool,
) -> list[torch.Tensor]:
    """uint8 images (C, H_i, W_i), already warped in warp mode (``warp`` > 0: the side the crops are drawn
    on) -> uint8 (C, size, size) each: `TrainAugment.augment` of each in turn."""
    out: list[torch.Tensor] = []
    for image in images:
        height, width = image.shape[-2], image.shape[-1]
        if warp > 0:
            height, width = warp, warp
        area = height * width
        top, left, h, w = 0, 0, height, width
        found = False
        for _ in range(10):  # RandomResizedCrop's tries, its generator calls one for one
            target_area = area * float(torch.empty([1]).uniform_(scale[0], scale[1]).item())
            aspect = float(torch.exp(torch.empty([1]).uniform_(log_ratio[0], log_ratio[1])).item())
            w = _round(math.sqrt(target_area * aspect))
            h = _round(math.sqrt(target_area / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, [1]).item())
                left = int(torch.randint(0, width - w + 1, [1]).item())
                found = True
                break
        if not found:  # its fallback: the centre crop of the whole image clamped to the ratio range
            in_ratio = width / height
            if in_ratio < min(ratio):
                w, h = width, _round(width / min(ratio))
            elif in_ratio > max(ratio):
                w, h = _round(height * max(ratio)), height
            else:
                w, h = width, height
            top, left = (height - h) // 2, (width - w) // 2
        mirror = flip and float(torch.rand([1]).item()) < 0.5  # RandomHorizontalFlip's coin
        crop = image[:, top : top + h, left : left + w]
        if h != size or w != size:
            crop = nn_functional.interpolate(
                crop.unsqueeze(0), size=[size, size], mode="bilinear", align_corners=False, antialias=True
            ).squeeze(0)
        out.append(crop.flip(-1) if mirror else crop)
    return out


@functools.cache
def _scripted() -> DrawnCrops:
    with warnings.catch_warnings():  # its deprecation notice (torch >= 2.10) is for model export
        warnings.simplefilter("ignore", FutureWarning)
        return torch.jit.script(drawn_crops_loop)


_SCRIPT_FAILED: list[str] = []  # why the compiled loop was given up in this process, once it was


def drawn_crops(
    images: list[torch.Tensor],
    size: int,
    scale: list[float],
    log_ratio: list[float],
    ratio: list[float],
    warp: int,
    flip: bool,
) -> list[torch.Tensor]:
    """`drawn_crops_loop`, compiled where TorchScript can. Should the compiled loop fail where the Python
    loop does not (a torch without TorchScript, a gap in some build), the generator is put back and the
    process crops in Python from then on, with one warning: the same draws and pixels either way. An error
    the inputs cause is raised by the Python loop, as it would be."""
    args = (images, size, scale, log_ratio, ratio, warp, flip)
    if not _SCRIPT_FAILED:
        state = torch.get_rng_state()
        try:
            return _scripted()(*args)
        except Exception as exc:  # compiling or running it: the Python loop decides
            torch.set_rng_state(state)
            out = drawn_crops_loop(*args)
            _SCRIPT_FAILED.append(first_line(exc))
            log.warning("the compiled crop loop failed (%s); cropping in Python from now on", first_line(exc))
            return out
    return drawn_crops_loop(*args)
