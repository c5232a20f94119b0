"""The device decode path's per-image crop and resample loop, compiled by TorchScript so that it does not
fight the training thread for the GIL.

Why: with ``data.decode: gpu`` a thread of the training process crops and resamples thousands of decoded
images a step, one `interpolate` per image. In Python every one of those torch calls drops the GIL and has
to win it back from the training thread (which launches the step's kernels meanwhile): each slows the
other down. TorchScript's interpreter runs the loop's calls without handing the GIL back and forth per
call. `python bench/decode_thread.py` (2 cores, CPU): a training-like thread kept 0.52x of its speed beside
the loop in Python and 0.98x beside the compiled loop, which itself ran twice as fast. The loop is the same
torch calls in the same order, so the pixels are those of the Python loop (`crops_resampled` runs as plain
Python where TorchScript is unavailable).

No ``from __future__ import annotations`` here: TorchScript reads these annotations.
"""

import functools
import logging
import warnings
from collections.abc import Callable

import torch
from torch.nn import functional as nn_functional

from dmltrain.data.device_memory import raise_if_out_of_memory
from dmltrain.data.errors import first_line

log = logging.getLogger(__name__)

CropLoop = Callable[[list[torch.Tensor], list[list[int]], int, int, str, bool | None, bool], torch.Tensor]


def crops_resampled(
    images: list[torch.Tensor],
    boxes: list[list[int]],
    size: int,
    warp: int,
    mode: str,
    align_corners: bool | None,
    antialias: bool,
) -> torch.Tensor:
    """uint8 images (C, H_i, W_i) and boxes [top, left, height, width] -> float (n, C, size, size), unrounded.

    With `warp` > 0 each image is first resampled to warp x warp and rounded (torchvision returns uint8 in
    between). A box past the image's edge is zero-padded there, as torchvision's crop does."""
    crops: list[torch.Tensor] = []
    for i in range(len(images)):
        image = images[i]
        if warp > 0 and (image.shape[-2] != warp or image.shape[-1] != warp):
            warped = nn_functional.interpolate(
                image.unsqueeze(0).float(),
                size=[warp, warp],
                mode=mode,
                align_corners=align_corners,
                antialias=antialias,
            )
            image = warped[0].clamp_(0, 255).round_()
        top, left, height, width = boxes[i][0], boxes[i][1], boxes[i][2], boxes[i][3]
        rows, cols = image.shape[-2], image.shape[-1]
        bottom, right = top + height, left + width
        crop = image[:, max(top, 0) : bottom, max(left, 0) : right].unsqueeze(0).float()
        if top < 0 or left < 0 or bottom > rows or right > cols:  # never drawn; padded as torchvision pads
            padding = [
                max(min(right, 0) - left, 0),
                max(right - max(cols, left), 0),
                max(min(bottom, 0) - top, 0),
                max(bottom - max(rows, top), 0),
            ]
            crop = nn_functional.pad(crop, padding, mode="constant", value=0.0)
        if height != size or width != size:
            crop = nn_functional.interpolate(
                crop, size=[size, size], mode=mode, align_corners=align_corners, antialias=antialias
            )
        crops.append(crop)
    return torch.cat(crops)


@functools.cache
def scripted_crops() -> CropLoop:
    """`crops_resampled` compiled by TorchScript (once per process), or the Python function where that fails
    (a torch without TorchScript, sources not shipped): the same pixels, trading the GIL at every call."""
    try:
        with warnings.catch_warnings():  # its deprecation notice (torch >= 2.10) is for model export
            warnings.simplefilter("ignore", FutureWarning)
            return torch.jit.script(crops_resampled)
    except Exception as exc:  # any failure to compile leaves the Python loop, which works
        log.warning("TorchScript cannot compile the crop loop (%s); it runs in Python", exc)
        return crops_resampled


_SCRIPT_FAILED: list[str] = []  # why the compiled loop was given up in this process, once it was


def crops(
    images: list[torch.Tensor],
    boxes: list[list[int]],
    size: int,
    warp: int,
    mode: str,
    align_corners: bool | None,
    antialias: bool,
    *,
    off_the_gil: bool = True,
) -> torch.Tensor:
    """`crops_resampled`, compiled where possible (``off_the_gil``). Should the compiled loop fail where the
    Python loop does not (a TorchScript gap in some torch build or device), the process keeps cropping in
    Python, with one warning; an error the inputs cause is raised by the Python loop, as it would be."""
    args = (images, boxes, size, warp, mode, align_corners, antialias)
    if off_the_gil and not _SCRIPT_FAILED:
        try:
            return scripted_crops()(*args)
        except RuntimeError as exc:
            raise_if_out_of_memory(exc)  # a full GPU, not a TorchScript gap: no Python retry, no switch
            out = crops_resampled(*args)
            _SCRIPT_FAILED.append(first_line(exc))
            log.warning(
                "the TorchScript crop loop failed (%s); cropping in Python from now on", _SCRIPT_FAILED[0]
            )
            return out
    return crops_resampled(*args)
