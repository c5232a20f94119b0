"""Backbones by name: ``resnet50`` (torchvision), ``timm:<name>`` and ``open_clip:<name>``.

Each library ("family") answers the same few questions — is this name valid, what preprocessing does it
expect, build it (optionally with weights), swap its global average pool for GeM, expose intermediate
feature maps — so the embedding network on top (`dmltrain.models.net`) is the same for all of them.
timm and open_clip are optional extras; naming one of their models without them installed is an error
that says which extra to install.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from dmltrain.models.common import (
    BackboneName,
    Built,
    Tapped,
    check_weights_file,
    is_weights_file,
    parse_backbone,
)
from dmltrain.models.preprocessing import PreprocessConfig


class Family(Protocol):
    """What each backbone library provides (see the module docstring)."""

    def validate(self, name: str, weights: str | None, backbone: str) -> None:
        """Raise ValueError naming ``model.backbone`` / ``model.weights`` when either is unknown."""

    def preprocessing(self, name: str, weights: str | None, kwargs: dict[str, Any]) -> PreprocessConfig:
        """The test-time preprocessing these weights were trained with (the architecture's default)."""

    def create(
        self,
        name: str,
        weights: str | None,
        state: dict[str, torch.Tensor] | None,
        image_size: int | None,
        kwargs: dict[str, Any],
        download: bool,
        source: str = "",
    ) -> Built:
        """Build the model without its classifier, with the tensors of a local file (``state``, read from
        ``source``) or with named weights (which may download; only when ``download`` is true)."""

    def use_gem(self, module: nn.Module, p: float, backbone: str) -> None:
        """Replace the global average pooling by GeM in place."""

    def taps(self, module: nn.Module, which: list[str] | None, backbone: str) -> Tapped:
        """Intermediate maps at ``which`` (default: three depths, as RLL's L/M/H)."""


def family(kind: str) -> Family:
    if kind == "timm":
        from dmltrain.models._timm import TimmFamily

        return TimmFamily()
    if kind == "open_clip":
        from dmltrain.models._openclip import OpenClipFamily

        return OpenClipFamily()
    from dmltrain.models._torchvision import TorchvisionFamily

    return TorchvisionFamily()


def validate_backbone(backbone: str, weights: str | None = None) -> BackboneName:
    """Check the name and the weights name/tag/file without building anything (cheap, no download)."""
    parsed = parse_backbone(backbone)
    family(parsed.kind).validate(parsed.name, weights, backbone)
    if is_weights_file(weights):
        check_weights_file(weights)  # type: ignore[arg-type]
    return parsed


def preprocessing_for(
    backbone: str, weights: str | None = None, backbone_kwargs: dict[str, Any] | None = None
) -> PreprocessConfig:
    """The preprocessing ``backbone`` with ``weights`` expects: resolution, resize, mean/std, interpolation.

    Taken from the model's own metadata — torchvision's weight transforms (a local torchvision file is
    matched to its weights entry by file name), timm's pretrained_cfg, open_clip's model and pretrained
    configs — never assumed. ``backbone_kwargs`` are the constructor overrides (timm ``img_size``, open_clip
    ``force_image_size``) that change the resolution.
    """
    parsed = validate_backbone(backbone, weights)
    return family(parsed.kind).preprocessing(parsed.name, weights, dict(backbone_kwargs or {}))
