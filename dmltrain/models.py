"""Embedding networks: a torchvision backbone, its classifier swapped for a linear embedding, L2-normalised.

The papers fine-tune ImageNet backbones this way (FastAP Sec. 5.1, Smooth-AP Sec. 5.3, RLL Sec. 4.1.3)
and train the new embedding layer with a 10x learning rate, so the model keeps the head separate to make
that parameter group easy to build.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

# ImageNet statistics: torchvision backbones expect inputs normalised with them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# Constructor arguments some randomly initialised backbones need to drop their auxiliary classifiers.
_BACKBONE_KWARGS: dict[str, dict[str, object]] = {
    "googlenet": {"aux_logits": False, "init_weights": False},
    "inception_v3": {"aux_logits": False, "init_weights": False},
}


class EmbeddingNet(nn.Module):
    """Backbone features -> linear embedding -> unit L2 norm (what every ranking loss expects)."""

    def __init__(self, backbone: nn.Module, feature_dim: int, embedding_dim: int) -> None:
        super().__init__()
        self.backbone = backbone
        self.embedding = nn.Linear(feature_dim, embedding_dim)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        features = self.backbone(images)
        if isinstance(features, tuple):  # some torchvision models return namedtuples in train mode
            features = features[0]
        return F.normalize(self.embedding(features.flatten(1)).float(), dim=1)


def _strip_classifier(model: nn.Module, name: str) -> int:
    """Replace the last ``nn.Linear`` (the ImageNet classifier) with Identity; return its input size.

    torchvision names the classifier differently per family (fc, classifier, heads.head, ...), but it is
    always the last Linear layer registered, which makes this work for resnets, googlenet, mobilenets,
    efficientnets, convnexts, regnets, densenets and vits alike.
    """
    last: tuple[str, nn.Linear] | None = None
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last = (module_name, module)
    if last is None:
        raise ValueError(f"model.backbone={name!r}: no Linear classifier found to replace")
    path, linear = last
    parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
    setattr(parent, path.rsplit(".", 1)[-1], nn.Identity())
    return linear.in_features


def _looks_like_file(weights: str) -> bool:
    suffixes = (".pt", ".pth", ".bin", ".safetensors")
    return os.sep in weights or weights.endswith(suffixes) or Path(weights).exists()


def _check_backbone_name(name: str) -> None:
    if name not in torchvision.models.list_models(module=torchvision.models):
        raise ValueError(
            f"model.backbone={name!r} is not a torchvision classification model; try one of "
            f"resnet18, resnet50, googlenet, mobilenet_v2, efficientnet_b0, convnext_tiny"
        )


def _named_weights(name: str, weights: str | None) -> torchvision.models.WeightsEnum | None:
    """The torchvision weights enum a name like ``IMAGENET1K_V2`` means (no download); None for a file."""
    if weights is None or _looks_like_file(weights):
        return None
    try:
        return torchvision.models.get_model_weights(name)[weights.rsplit(".", 1)[-1]]
    except KeyError:
        options = [w.name for w in torchvision.models.get_model_weights(name)]
        raise ValueError(f"model.weights={weights!r}: {name} offers {[*options, 'DEFAULT']}") from None


def check_model(backbone: str, embedding_dim: int, weights: str | None = None) -> None:
    """Raise the error :func:`build_model` would raise, without allocating or downloading anything.

    The network is built on PyTorch's meta device (shapes only), named weights are looked up but not
    fetched, and a weights file is opened memory-mapped and matched against the model's keys and shapes.
    A launcher calls this before it starts workers, so a typo never reaches them.
    """
    _check_backbone_name(backbone)
    _named_weights(backbone, weights)
    with torch.device("meta"):
        net = torchvision.models.get_model(backbone, weights=None, **_BACKBONE_KWARGS.get(backbone, {}))
        model = EmbeddingNet(net, _strip_classifier(net, backbone), embedding_dim)
    if weights is not None and _looks_like_file(weights):
        with warnings.catch_warnings():  # copying into meta tensors is the intended no-op here
            warnings.filterwarnings("ignore", message=".*meta parameter in the current model.*")
            load_weights_file(model, weights, mmap=True)


def build_backbone(name: str, weights: str | None) -> nn.Module:
    """Instantiate a torchvision classification model by name with optional named weights.

    Named weights (``IMAGENET1K_V2``, ``DEFAULT``, ``ResNet50_Weights.IMAGENET1K_V2``) download through
    torchvision's cache on first use; a local file is loaded by :func:`build_model` after construction.
    """
    _check_backbone_name(name)
    named = _named_weights(name, weights)
    # With named weights torchvision drops the auxiliary heads itself and refuses our overrides.
    kwargs = _BACKBONE_KWARGS.get(name, {}) if named is None else {}
    return torchvision.models.get_model(name, weights=named, **kwargs)


def load_weights_file(model: nn.Module, path: str, mmap: bool = False) -> None:
    """Load a local state dict into the whole model or, failing that, into its backbone.

    Accepts a dmltrain checkpoint (``{"model": state_dict}``), a full EmbeddingNet state dict, or a plain
    torchvision backbone state dict (its classifier keys are ignored, anything else missing is an error).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model.weights: file not found: {file}")
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # pickled objects (refused by weights_only), a truncated or foreign file
        raise ValueError(
            f"model.weights={path}: not a loadable state dict ({type(exc).__name__}: {exc})"
        ) from exc
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    if any(key.startswith("backbone.") for key in state):
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:  # missing/unexpected keys or shapes from another embedding size
            raise ValueError(f"model.weights={path}: does not fit this model: {exc}") from exc
        return
    assert isinstance(model, EmbeddingNet)
    own = model.backbone.state_dict()
    usable = {k: v for k, v in state.items() if k in own}
    missing = sorted(set(own) - set(usable))
    if missing:
        raise ValueError(f"model.weights={path}: {len(missing)} backbone tensors missing, e.g. {missing[:3]}")
    model.backbone.load_state_dict(usable)


def build_model(backbone: str, embedding_dim: int, weights: str | None = None) -> EmbeddingNet:
    """The embedding network of the papers: backbone + linear embedding + L2 normalisation."""
    net = build_backbone(backbone, weights)
    feature_dim = _strip_classifier(net, backbone)
    model = EmbeddingNet(net, feature_dim, embedding_dim)
    if weights is not None and _looks_like_file(weights):
        load_weights_file(model, weights)
    return model


def parameter_groups(model: EmbeddingNet, lr: float, embedding_lr_mult: float) -> list[dict]:
    """Backbone at the base learning rate, the new embedding layer at ``embedding_lr_mult`` times it."""
    return [
        {"params": [p for p in model.backbone.parameters() if p.requires_grad], "lr": lr, "name": "backbone"},
        {"params": list(model.embedding.parameters()), "lr": lr * embedding_lr_mult, "name": "embedding"},
    ]


def freeze_batchnorm(model: nn.Module) -> None:
    """Put every BatchNorm layer in eval mode (running statistics), as the papers' fine-tuning does."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, C, H, W) -> float ImageNet-normalised, done per chunk on the compute device."""
    mean = torch.tensor(IMAGENET_MEAN, device=images.device).view(1, -1, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=images.device).view(1, -1, 1, 1)
    x = images.float().div_(255.0)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    return (x - mean) / std
