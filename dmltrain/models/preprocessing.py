"""What a backbone expects of its input images: resolution, resize rule, interpolation, mean and std.

Each pretrained backbone was trained with its own recipe (ImageNet statistics for torchvision, 0.5/0.5 for
some timm ports, OpenAI's statistics and bicubic resizing for CLIP), and a fine-tune or an index built with
another recipe quietly loses accuracy. `PreprocessConfig` is that recipe as plain data; the training data
transforms, the model-side normalisation and the serving model all read it from here, so they agree.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

import torch

# ImageNet statistics: torchvision backbones (and most timm ones) expect inputs normalised with them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Interpolation = Literal["bilinear", "bicubic", "nearest"]
CropMode = Literal["center", "squash"]
INTERPOLATIONS: tuple[str, ...] = ("bilinear", "bicubic", "nearest")
# The data transforms' resize_mode for each crop_mode (the papers' "warp" is timm/open_clip's "squash").
RESIZE_MODE_OF_CROP: dict[str, Literal["shorter_side", "warp"]] = {"center": "shorter_side", "squash": "warp"}
CROP_MODE_OF_RESIZE: dict[str, CropMode] = {"shorter_side": "center", "warp": "squash"}


@dataclass(frozen=True)
class PreprocessConfig:
    """Test-time preprocessing of one backbone.

    resolution: side of the square crop the network sees.
    resize: test time, the shorter side is resized to this (``crop_mode="center"``) or the whole image is
        squashed to ``resize x resize`` (``"squash"``), then the centre ``resolution`` square is cropped.
        Training crops the original image, or in ``"squash"`` mode the squashed one (the data config's
        ``resize_mode``: ``shorter_side`` is ``center``, ``warp`` is ``squash``).
    mean, std: per-channel statistics applied to [0, 1] RGB values.
    interpolation: resampling filter of every resize (train and test).
    """

    resolution: int
    resize: int
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    interpolation: Interpolation = "bilinear"
    crop_mode: CropMode = "center"

    def __post_init__(self) -> None:
        if self.resolution < 1 or self.resize < self.resolution:
            raise ValueError(f"need 1 <= resolution <= resize, got {self.resolution} and {self.resize}")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")
        if self.crop_mode not in ("center", "squash"):
            raise ValueError(f"crop_mode must be 'center' or 'squash', got {self.crop_mode!r}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if len(value) != 3:
                raise ValueError(f"{name} needs 3 values (RGB), got {value!r}")
            object.__setattr__(self, name, tuple(float(v) for v in value))
        if min(self.std) <= 0:
            raise ValueError(f"std must be positive, got {self.std}")

    @property
    def crop_pct(self) -> float:
        """Share of the resized image the centre crop keeps (timm's name for resolution / resize)."""
        return self.resolution / self.resize

    @classmethod
    def from_crop_pct(cls, resolution: int, crop_pct: float, **kwargs: Any) -> PreprocessConfig:
        """timm's rule: resize = floor(resolution / crop_pct)."""
        if not 0 < crop_pct <= 1:
            raise ValueError(f"crop_pct must lie in (0, 1], got {crop_pct}")
        return cls(resolution=resolution, resize=max(resolution, math.floor(resolution / crop_pct)), **kwargs)

    def with_overrides(
        self,
        *,
        resolution: int | None = None,
        resize: int | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        interpolation: Interpolation | None = None,
        crop_mode: CropMode | None = None,
    ) -> PreprocessConfig:
        """The config with user overrides applied; None keeps the backbone's value. A new resolution
        without a new resize keeps the backbone's crop share (e.g. 224 -> 256 becomes 112 -> 128)."""
        size = resolution or self.resolution
        if resize is None:
            resize = (
                self.resize if size == self.resolution else max(size, math.floor(size / self.crop_pct + 1e-6))
            )
        return replace(
            self,
            resolution=size,
            resize=resize,
            mean=self.mean if mean is None else mean,
            std=self.std if std is None else std,
            interpolation=interpolation or self.interpolation,
            crop_mode=crop_mode or self.crop_mode,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly form (stored in the model file and read back by serving)."""
        out = asdict(self)
        out["mean"], out["std"] = list(self.mean), list(self.std)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PreprocessConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown preprocessing keys {unknown}")
        values = dict(data)
        for name in ("mean", "std"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)

    def normalizer(self) -> ImageNormalizer:
        """uint8 -> normalised float, run per chunk on the compute device."""
        return ImageNormalizer(self.mean, self.std)

    @property
    def resize_mode(self) -> Literal["shorter_side", "warp"]:
        """The data transforms' name for ``crop_mode`` (squash = the papers' warp)."""
        return RESIZE_MODE_OF_CROP[self.crop_mode]

    def test_transform(self):  # -> dmltrain.data.transforms.Transform
        """Resize + centre crop on uint8 (C, H, W) tensors, as evaluation and serving apply it."""
        from dmltrain.data.transforms import test_transform

        return test_transform(self.resolution, self.resize, self.resize_mode, self.interpolation)

    def train_transform(
        self, scale: tuple[float, float], flip: bool = True
    ):  # -> dmltrain.data.transforms.TrainAugment
        """The training crops at this resolution, with this resize rule and interpolation."""
        from dmltrain.data.transforms import train_transform

        return train_transform(
            self.resolution,
            scale=scale,
            flip=flip,
            resize_mode=self.resize_mode,
            resize=self.resize,
            interpolation=self.interpolation,
        )


class ImageNormalizer:
    """uint8 (B, C, H, W) -> float32 ``(x / 255 - mean) / std``; grey inputs are repeated to RGB.

    A small picklable object rather than a closure, so it can travel to DataLoader workers and Ray actors.
    The mean and std tensors are made once per device and kept: building them from Python floats on a
    CUDA device is a copy from pageable memory, which waits for the stream to drain. Once per chunk that
    was 64 waits per step of B=4,096 in chunks of 256, so the host could never queue work ahead of the
    GPU, and any pause of the training thread left the GPU idle (torch.profiler trace, one H100).
    """

    def __init__(
        self, mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD
    ) -> None:
        self.mean = tuple(float(v) for v in mean)
        self.std = tuple(float(v) for v in std)
        self._constants: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, std) as float32 (1, C, 1, 1) tensors on `device`, made on first use there."""
        found = self._constants.get(device)
        if found is None:
            mean = torch.tensor(self.mean, device=device).view(1, -1, 1, 1)
            std = torch.tensor(self.std, device=device).view(1, -1, 1, 1)
            found = self._constants[device] = (mean, std)
        return found

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        mean, std = self.constants(images.device)
        x = images.float().div_(255.0)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return (x - mean) / std

    def __getstate__(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std}  # device tensors stay behind; made again on use

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["mean"], state["std"])

    def __repr__(self) -> str:
        return f"ImageNormalizer(mean={self.mean}, std={self.std})"


@functools.cache
def _shared_normalizer(mean: tuple[float, ...], std: tuple[float, ...]) -> ImageNormalizer:
    return ImageNormalizer(mean, std)


def normalize_images(
    images: torch.Tensor,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> torch.Tensor:
    """uint8 (B, C, H, W) -> float normalised with ``mean``/``std`` (ImageNet's by default); one shared
    `ImageNormalizer` per (mean, std), so its device constants are made once."""
    return _shared_normalizer(tuple(mean), tuple(std))(images)
