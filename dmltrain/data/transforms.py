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

The train augmentation is a `TrainAugment`: its random parameters are drawn (`draw`, from torch's CPU
generator, exactly the draws of torchvision's RandomResizedCrop + RandomHorizontalFlip) apart from applying
them (`apply`, on a tensor on any device), so the GPU decode path (`dmltrain.data.device_decode`) draws
the crops in the loader workers and applies them on the GPU: a seed gives the same crops either way.

Sizes, the resize rule and the interpolation come from the backbone's preprocessing
(`dmltrain.models.preprocessing_for`) unless the config overrides them.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import numpy as np
import torch
from PIL import Image
from torch.nn import functional as nn_functional
from torchvision.transforms import InterpolationMode, v2
from torchvision.transforms.v2 import functional as F

from dmltrain.data.augment_loop import drawn_crops
from dmltrain.data.crops import crops

Transform = Callable[[torch.Tensor], torch.Tensor]
ResizeMode = Literal["shorter_side", "warp"]
RESIZE_MODES: tuple[ResizeMode, ...] = ("shorter_side", "warp")


# Where PIL finds an EXIF orientation (`Image.getexif`): looked at only when one of these is there.
_EXIF_KEYS = ("exif", "Raw profile type exif", "XML:com.adobe.xmp", "xmp")
_ORIENTATION = 0x0112
# EXIF orientation -> the transpose that shows the image upright (PIL.ImageOps.exif_transpose's table).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "RGBa"})
_GREY16_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})


def exif_orientation(image: Image.Image) -> int:
    """The image's EXIF orientation, 1 (stored upright) to 8; 1 without one, or when the EXIF block is
    unreadable (such images decoded before, and still do). A PNG's eXIf chunk may follow its pixels: read
    it after ``image.load()``."""
    if image.format != "TIFF" and not any(key in image.info for key in _EXIF_KEYS):
        return 1  # the hot path: no EXIF to parse
    try:
        return int(image.getexif().get(_ORIENTATION, 1))
    except Exception:  # a damaged EXIF block (PIL raises SyntaxError, struct.error, ValueError...)
        return 1


def flatten(image: Image.Image, keep_grey: bool = False) -> Image.Image:
    """The 8-bit, upright, opaque image that training, evaluation, serving and `dmltrain prepare`'s re-encode
    all see: mode "RGB", or "L" for a grey source when `keep_grey`.

    Why not just ``convert("RGB")``: it drops alpha, keeping whatever colour lies under alpha 0 (a black
    cut-out on a transparent background becomes all black), so images with alpha (RGBA/LA/PA, or a
    ``transparency`` colour in a P/L/RGB PNG) are composited onto white, as product photos and cut-outs
    are shown; it clips 16-bit grey to white, so those are scaled to 8 bits (65535 -> 255); it clips
    32-bit float grey (TIFF) too, which turned the usual 0..1 floats black: see `_float_as_8_bits`; and it
    ignores the EXIF orientation a camera writes instead of rotating the pixels, which is applied here.
    8-bit RGB and L sources without alpha or an EXIF turn come back as they are (no copy); CMYK, palette
    and bilevel images convert as before.
    """
    image.load()  # PNG chunks after the pixels (eXIf, tRNS) are in `info` only then
    orientation = exif_orientation(image)
    if orientation in _UPRIGHT:
        image = image.transpose(_UPRIGHT[orientation])  # PIL's savers do not copy `info`'s EXIF: no 2nd turn
    if image.mode in _GREY16_MODES:
        values = np.clip(np.asarray(image), 0, 65535).astype(np.uint32)
        image = Image.fromarray(((values + 128) // 257).astype(np.uint8))  # rounded value / 257
    elif image.mode == "F":
        image = _float_as_8_bits(image)
    mode = image.mode
    if mode in _ALPHA_MODES or "transparency" in image.info:
        grey = keep_grey and mode in ("L", "LA")
        with_alpha = image.convert("LA" if grey else "RGBA")
        flat = Image.new("L" if grey else "RGB", image.size, "white")
        flat.paste(with_alpha, mask=with_alpha.getchannel("A"))
        return flat
    if mode == "RGB" or (keep_grey and mode == "L"):
        return image
    return image.convert("RGB")


def _float_as_8_bits(image: Image.Image) -> Image.Image:
    """Float grey pixels (PIL mode "F") as 8 bits: 0..1 is the float-image convention (scaled by 255), 0..255
    PIL's own (kept); any other range has no one reading, so it is refused (ValueError) rather than guessed
    (a stretch per image would make a dark photo and a bright one alike)."""
    values = np.asarray(image, dtype=np.float32)
    if not np.isfinite(values).all():
        raise ValueError("float pixels include NaN or infinity")
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 0.0)
    if low < 0 or high > 255:
        raise ValueError(
            f"float pixels range over [{low:g}, {high:g}], neither 0..1 nor 0..255: convert the image to "
            "8 or 16 bits"
        )
    scale = 255.0 if high <= 1 else 1.0
    return Image.fromarray(np.round(values * scale).astype(np.uint8))


def decode(data: bytes, keep_grey: bool = False) -> torch.Tensor:
    """Encoded JPEG/PNG/WebP bytes -> uint8 (3, H, W), by `flatten` (upright, alpha on white, 8 bits).

    ``keep_grey``: a greyscale source (mode "L", 16-bit grey, grey with alpha) stays one channel, (1, H, W),
    so a transform that treats channels alike (crops, resizes, flips: `treats_channels_alike`) does a third
    of the pixel work; `as_rgb` then repeats the channel, which gives exactly what converting first would
    have. PIL rather than torchvision.io, whose decoders are deprecated since torchvision 0.29 (same libjpeg).
    """
    with Image.open(io.BytesIO(data)) as image:
        array = np.array(flatten(image, keep_grey))
    tensor = torch.from_numpy(array)
    return tensor.unsqueeze(0) if tensor.ndim == 2 else tensor.permute(2, 0, 1)


def as_rgb(image: torch.Tensor) -> torch.Tensor:
    """(1, H, W) -> (3, H, W) without copying (a view; stacking a batch makes the copy); RGB as is."""
    return image.expand(3, -1, -1) if image.shape[-3] == 1 else image


def treats_channels_alike(transform: object) -> bool:
    """Whether `transform` commutes with repeating a grey channel: this module's geometric transforms. A
    user's transform (colour jitter, normalisation...) may not, so it always gets RGB."""
    if isinstance(transform, TrainAugment):
        return True
    return isinstance(transform, v2.Compose) and all(
        isinstance(step, (v2.Resize, v2.CenterCrop)) for step in transform.transforms
    )


def default_resize(size: int) -> int:
    """The papers' 256 for 224 crops, scaled to other crop sizes."""
    return round(size * 256 / 224)


def _check_mode(resize_mode: str) -> None:
    if resize_mode not in RESIZE_MODES:
        raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {resize_mode!r}")


def _mode(interpolation: str) -> InterpolationMode:
    try:
        return InterpolationMode(interpolation)
    except ValueError:
        raise ValueError(
            f"unknown interpolation {interpolation!r}: use bilinear, bicubic or nearest"
        ) from None


class CropFlip(NamedTuple):
    """One image's augmentation: the crop box (pixels of the decoded image, or of the warped square in warp
    mode) and whether to flip it."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


class TrainAugment:
    """RandomResizedCrop to `size` (antialiased) + horizontal flip, of the original image or, with
    ``resize_mode="warp"``, of the image first warped to `resize` x `resize` (aspect ratio ignored), with
    the random draw apart from the pixel work. Called on an image it is the torchvision v2 pipeline it
    replaces ([Resize,] RandomResizedCrop, RandomHorizontalFlip): the same generator calls in the same order
    (crop, then the flip's coin), so a seed gives the same crops as before."""

    def __init__(
        self,
        size: int = 224,
        scale: tuple[float, float] = (0.16, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        flip: bool = True,
        *,
        resize_mode: ResizeMode = "shorter_side",
        resize: int | None = None,
        interpolation: str = "bilinear",
    ) -> None:
        _check_mode(resize_mode)
        self.size = size
        self.flip = flip
        self.warp = (resize or default_resize(size)) if resize_mode == "warp" else None
        self.interpolation = _mode(interpolation)
        self.scale, self.ratio = scale, ratio
        # float32 logs, as torchvision keeps them: the same draws to the last bit
        self._log_ratio = tuple(float(v) for v in torch.log(torch.tensor(ratio)))

    def draw(self, height: int, width: int) -> CropFlip:
        """Parameters for an image of `height` x `width`, from torch's default CPU generator.

        torchvision's `RandomResizedCrop.make_params`, call for call on the generator (a test holds them
        equal), without its input inspection: a third of the cost, which the loader pays per image."""
        if self.warp is not None:
            height = width = self.warp
        top, left, crop_height, crop_width = self._crop_box(height, width)
        flip = self.flip and bool(torch.rand(1) < 0.5)  # RandomHorizontalFlip(p=0.5)'s coin
        return CropFlip(top, left, crop_height, crop_width, flip)

    def _crop_box(self, height: int, width: int) -> tuple[int, int, int, int]:
        area = height * width
        (low, high), (log_low, log_high) = self.scale, self._log_ratio
        for _ in range(10):  # up to 10 tries for a box inside the image, as torchvision
            target_area = area * torch.empty(1).uniform_(low, high).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_low, log_high)).item()
            w = round(math.sqrt(target_area * aspect_ratio))
            h = round(math.sqrt(target_area / aspect_ratio))
            if 0 < w <= width and 0 < h <= height:
                top = int(torch.randint(0, height - h + 1, size=(1,)).item())
                left = int(torch.randint(0, width - w + 1, size=(1,)).item())
                return top, left, h, w
        # torchvision's fallback: the centre crop of the whole image clamped to the ratio range
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, round(width / min(self.ratio))
        elif in_ratio > max(self.ratio):
            w, h = round(height * max(self.ratio)), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def apply(self, image: torch.Tensor, params: CropFlip) -> torch.Tensor:
        """uint8 (C, H, W) on any device -> uint8 (C, size, size)."""
        return self.crop_flip(self.prepare(image), params)

    def prepare(self, image: torch.Tensor) -> torch.Tensor:
        """The part of the transform that is the same at every pass: the warp to `resize` squared in warp
        mode, else the image itself. A loader may keep its result (`dmltrain.data.cache`)."""
        if self.warp is None:
            return image
        return F.resize(image, [self.warp, self.warp], interpolation=self.interpolation, antialias=True)

    def augment(self, prepared: torch.Tensor) -> torch.Tensor:
        """The random part on a `prepare`d image: ``self(image) == self.augment(self.prepare(image))``, with
        the same draws. Never writes to ``prepared``."""
        return self.crop_flip(prepared, self.draw(*prepared.shape[-2:]))

    def augment_many(self, prepared: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`augment` of each image in turn, pixel for pixel and draw for draw. On the CPU's native path
        (uint8, bilinear) in one compiled loop (`dmltrain.data.augment_loop`): a third less of a loader's CPU
        a batch of small images, where the Python around each image's draws and resize weighs most."""
        native = self.interpolation == InterpolationMode.BILINEAR and all(
            x.device.type == "cpu" and x.dtype == torch.uint8 and x.ndim == 3 for x in prepared
        )
        # A subclass that draws or crops its own way keeps its own steps.
        steps = ("augment", "draw", "crop_flip", "_resized_crop")
        own_steps = any(getattr(type(self), name) is not getattr(TrainAugment, name) for name in steps)
        if not native or own_steps:
            return [self.augment(image) for image in prepared]
        return drawn_crops(
            list(prepared),
            self.size,
            [float(v) for v in self.scale],
            list(self._log_ratio),
            [float(v) for v in self.ratio],
            self.warp or 0,
            self.flip,
        )

    def crop_flip(self, prepared: torch.Tensor, params: CropFlip) -> torch.Tensor:
        top, left, height, width, flip = params
        out = self._resized_crop(prepared, top, left, height, width)
        return F.horizontal_flip(out) if flip else out

    def _resized_crop(
        self, image: torch.Tensor, top: int, left: int, height: int, width: int
    ) -> torch.Tensor:
        """`F.resized_crop`; on CPU uint8 bilinear (torchvision's own native path) a slice and one
        `interpolate` call, bit for bit the same (a test holds them equal) without torchvision's dispatch,
        which costs as much as the resize of a small image."""
        rows, cols = image.shape[-2:]
        inside = top >= 0 and left >= 0 and top + height <= rows and left + width <= cols
        native = image.device.type == "cpu" and image.dtype == torch.uint8 and image.ndim == 3
        if not (inside and native and self.interpolation == InterpolationMode.BILINEAR):
            return F.resized_crop(
                image, top, left, height, width, [self.size, self.size], self.interpolation, antialias=True
            )
        crop = image[:, top : top + height, left : left + width]
        if (height, width) == (self.size, self.size):
            return crop
        size = (self.size, self.size)
        out = nn_functional.interpolate(
            crop.unsqueeze(0), size=size, mode="bilinear", align_corners=False, antialias=True
        )
        return out.squeeze(0)

    def apply_batch(self, images: Sequence[torch.Tensor], params: Sequence[CropFlip]) -> torch.Tensor:
        """uint8 images (C, H_i, W_i) on one device -> uint8 (n, C, size, size): `apply` to each, bit for bit.

        Why: off the CPU, torchvision's uint8 resize casts to float, resamples, rounds and casts back, then
        flips: four or five kernel launches and its dispatch per image, on the thread that feeds a GPU step of
        thousands of images (the GPU decode path's, beside the training thread). Here each image costs a
        cast and one resample, in a loop compiled by TorchScript (no GIL hand-off at every torch call);
        rounding, flips and the cast back run once on the batch. On the CPU, uint8 bilinear resizes
        natively (different rounding), so there it is `apply` image by image."""
        if len(images) != len(params):
            raise ValueError(f"{len(images)} images but {len(params)} crop parameters")
        if not images:
            return torch.empty((0, 3, self.size, self.size), dtype=torch.uint8)
        if images[0].device.type == "cpu" or self.interpolation not in _RESAMPLE_MODES:
            return torch.stack([self.apply(image, p) for image, p in zip(images, params, strict=True)])
        return self.resample_batch(images, params)

    def resample_batch(
        self, images: Sequence[torch.Tensor], params: Sequence[CropFlip], *, off_the_gil: bool = True
    ) -> torch.Tensor:
        """`apply_batch` in float on any device: torchvision's non-native uint8 path (the one it takes on
        CUDA), which rounds once after each resample. Public so a CPU test can check it. The per-image loop
        is compiled by TorchScript, so that it does not trade the GIL with the training thread at every
        torch call (`dmltrain.data.crops`); ``off_the_gil=False`` runs the same loop in Python, for the
        benchmark that compares them."""
        mode = _RESAMPLE_MODES[self.interpolation]
        smooth = mode in ("bilinear", "bicubic")
        boxes = [[top, left, height, width] for top, left, height, width, _ in params]
        batch = crops(
            list(images),
            boxes,
            self.size,
            self.warp or 0,
            mode,
            False if smooth else None,
            smooth,
            off_the_gil=off_the_gil,
        )
        batch = batch.clamp_(0, 255).round_()
        flips = [i for i, p in enumerate(params) if p.flip]
        if flips:
            index = torch.tensor(flips, device=batch.device)
            batch.index_copy_(0, index, batch.index_select(0, index).flip(-1))
        return batch.to(torch.uint8)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return self.augment(self.prepare(image))


# What `TrainAugment.resample_batch` runs with `interpolate` (torchvision's other modes are PIL-only).
_RESAMPLE_MODES = {
    InterpolationMode.BILINEAR: "bilinear",
    InterpolationMode.BICUBIC: "bicubic",
    InterpolationMode.NEAREST: "nearest",
    InterpolationMode.NEAREST_EXACT: "nearest-exact",
}


def train_transform(
    size: int = 224,
    scale: tuple[float, float] = (0.16, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: bool = True,
    *,
    resize_mode: ResizeMode = "shorter_side",
    resize: int | None = None,
    interpolation: str = "bilinear",
) -> TrainAugment:
    """RandomResizedCrop to ``size`` (+ flip) of the original, or of the image warped to ``resize`` squared
    (``resize_mode="warp"``; ``resize`` defaults to `default_resize(size)`)."""
    return TrainAugment(
        size, scale, ratio, flip, resize_mode=resize_mode, resize=resize, interpolation=interpolation
    )


def test_transform(
    size: int = 224,
    resize: int | None = None,
    resize_mode: ResizeMode = "shorter_side",
    interpolation: str = "bilinear",
) -> Transform:
    """Shorter side to ``resize`` (or, with ``resize_mode="warp"``, the whole image to ``resize`` squared,
    as the papers and some timm/open_clip models are evaluated), then the centre crop of ``size``;
    ``resize`` defaults to `default_resize(size)`."""
    _check_mode(resize_mode)
    side = resize or default_resize(size)
    target: int | list[int] = [side, side] if resize_mode == "warp" else side
    return v2.Compose(
        [v2.Resize(target, interpolation=_mode(interpolation), antialias=True), v2.CenterCrop(size)]
    )


def resized_pixels(transform: Transform, height: int, width: int) -> int | None:
    """How many pixels `transform`'s first resize makes of a ``height`` x ``width`` image (a pipeline as
    `test_transform` builds), or None when it has none. The shorter side to ``s`` makes ``s`` x
    ``s * long / short``: a 500,000 x 1 PNG of a few hundred bytes becomes 256 x 128,000,000 at s=256."""
    resizes = [t for t in getattr(transform, "transforms", ()) if isinstance(t, v2.Resize)]
    if not resizes or resizes[0].size is None:
        return None
    size = list(resizes[0].size)
    if len(size) == 2:  # warped to a fixed size
        return int(size[0]) * int(size[1])
    side, short, long = int(size[0]), min(height, width), max(height, width)
    return side * max(side, -(-side * long // short))


def output_side(transform: Transform, default: int) -> int:
    """The side of the square images `transform` returns, where it says (a `TrainAugment`, or a pipeline
    ending in a centre crop as `test_transform`'s), else `default`."""
    if isinstance(transform, TrainAugment):
        return transform.size
    crops = [t for t in getattr(transform, "transforms", ()) if isinstance(t, v2.CenterCrop)]
    return int(crops[-1].size[0]) if crops else default
