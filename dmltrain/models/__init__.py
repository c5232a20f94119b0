"""Embedding networks on torchvision, timm and open_clip backbones, with each backbone's preprocessing.

Public entry points:
- `build_model(backbone, embedding_dim, weights, pooling=, multilevel=, image_size=, backbone_kwargs=)`:
  backbone + (GeM) pooling + linear embedding(s) + L2 norm; ``backbone`` is a torchvision name,
  ``timm:<name>`` or ``open_clip:<name>``; ``weights`` a weights name/tag or a local file.
- `preprocessing_for(backbone, weights, backbone_kwargs) -> PreprocessConfig`: the resolution, resize,
  mean/std and interpolation the backbone was trained with (data transforms, normalisation, serving).
- `check_model(...)`: the same build on the meta device, for validating a configuration up front.
- `parameter_groups`, `freeze_batchnorm`, `normalize_images`, `GeM`, `read_state_dict`.
"""

from dmltrain.models.backbones import preprocessing_for, validate_backbone
from dmltrain.models.common import BackboneName, MissingExtraError, is_weights_file, parse_backbone
from dmltrain.models.net import EmbeddingNet, build_model, check_model, freeze_batchnorm, parameter_groups
from dmltrain.models.pooling import GeM
from dmltrain.models.preprocessing import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    ImageNormalizer,
    PreprocessConfig,
    normalize_images,
)
from dmltrain.models.weights import read_state_dict

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BackboneName",
    "EmbeddingNet",
    "GeM",
    "ImageNormalizer",
    "MissingExtraError",
    "PreprocessConfig",
    "build_model",
    "check_model",
    "freeze_batchnorm",
    "is_weights_file",
    "normalize_images",
    "parameter_groups",
    "parse_backbone",
    "preprocessing_for",
    "read_state_dict",
    "validate_backbone",
]
