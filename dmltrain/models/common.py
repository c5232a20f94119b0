"""Pieces every backbone family shares: names, optional-extra imports, weights-file paths, build results."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Protocol

import torch
from torch import nn

PREFIXES = {"timm": "timm", "open_clip": "open_clip", "openclip": "open_clip", "torchvision": "torchvision"}
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt")


class MissingExtraError(ImportError):
    """A backbone family's library is not installed; the message names the pip extra that provides it."""


@dataclass(frozen=True)
class BackboneName:
    """``kind`` is torchvision, timm or open_clip; ``name`` the library's own model name."""

    kind: str
    name: str

    def __str__(self) -> str:
        return self.name if self.kind == "torchvision" else f"{self.kind}:{self.name}"


def parse_backbone(text: str) -> BackboneName:
    """``timm:convnext_tiny`` -> (timm, convnext_tiny); a name without a known prefix is torchvision's."""
    prefix, sep, rest = text.partition(":")
    if sep and prefix in PREFIXES:
        if not rest:
            raise ValueError(f"model.backbone={text!r}: the model name after {prefix!r}: is empty")
        return BackboneName(PREFIXES[prefix], rest)
    return BackboneName("torchvision", text)


def require(module: str, extra: str, backbone: str) -> ModuleType:
    """Import an optional library, or fail with the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"model.backbone={backbone!r} needs the {module} package: pip install 'dmltrain[{extra}]'"
        ) from exc


def is_weights_file(weights: str | None) -> bool:
    """A local path (has a directory part, a weights suffix, or exists) rather than a weights name/tag."""
    if weights is None:
        return False
    return os.sep in weights or weights.lower().endswith(WEIGHT_SUFFIXES) or Path(weights).exists()


def check_weights_file(weights: str) -> Path:
    file = Path(weights).expanduser()
    if not file.is_file():
        raise FileNotFoundError(f"model.weights: file not found: {file}")
    return file


class Taps(Protocol):
    """How a backbone hands out its intermediate feature maps (B, C, H, W), shallow to deep."""

    def __call__(self, backbone: nn.Module, images: torch.Tensor) -> list[torch.Tensor]: ...


@dataclass
class Built:
    """A backbone ready for the embedding head: ``module(images)`` gives pooled (B, feature_dim) features."""

    module: nn.Module
    feature_dim: int


@dataclass
class Tapped:
    """A backbone cut for a multi-level embedding: ``taps(module, images)`` gives one map per level."""

    module: nn.Module
    taps: Taps
    channels: list[int]
    names: list[str] = field(default_factory=list)
