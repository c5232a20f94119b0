"""The embedding network: backbone -> pooled features -> linear embedding -> unit L2 norm.

The papers fine-tune ImageNet backbones this way (FastAP Sec. 5.1, Smooth-AP Sec. 5.3, RLL Sec. 4.1.3)
and train the new embedding layer with a 10x learning rate, so the model keeps the head separate to make
that parameter group easy to build.

Multi-level (RLL Sec. 4.1.3-4.3): maps tapped at several depths are pooled, each gets its own linear
embedding and L2 norm, and the levels are concatenated. The concatenation is divided by sqrt(levels), so
the output is still a unit vector (every metric, index and loss expects one) whose cosine similarity is the
mean of the levels' cosines — the same ranking as the paper's plain concatenation. `LevelwiseLoss`
(dmltrain.losses) trains each level with its own loss, as the paper does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from dmltrain.models.backbones import family, validate_backbone
from dmltrain.models.common import Taps, is_weights_file
from dmltrain.models.pooling import GeM, pooling_parameters
from dmltrain.models.weights import is_embedding_state, read_state_dict

Pooling = Literal["avg", "gem"]


class EmbeddingNet(nn.Module):
    """Backbone features -> linear embedding -> unit L2 norm (what every ranking loss expects)."""

    def __init__(
        self,
        backbone: nn.Module,
        feature_dims: Sequence[int],
        embedding_dim: int,
        *,
        taps: Taps | None = None,
        pools: Sequence[nn.Module] | None = None,
        tap_names: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.output_dim = embedding_dim
        self.levels = len(feature_dims)
        self.tap_names = list(tap_names)
        self.taps = taps  # a plain callable (no parameters), or None when the backbone pools itself
        if taps is None:
            if len(feature_dims) != 1:
                raise ValueError("several feature sizes need taps that produce one map per level")
            self.embedding: nn.Module = nn.Linear(feature_dims[0], embedding_dim)
            return
        if embedding_dim % self.levels:
            raise ValueError(
                f"model.embedding_dim={embedding_dim} must be divisible by the {self.levels} levels of "
                "model.multilevel (each level gets an equal share)"
            )
        if pools is None or len(pools) != self.levels:
            raise ValueError("multi-level embedding needs one pooling module per level")
        per_level = embedding_dim // self.levels
        self.pools = nn.ModuleList(pools)
        self.embedding = nn.ModuleList(nn.Linear(d, per_level) for d in feature_dims)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if self.taps is None:
            features = self.backbone(images)
            if isinstance(features, tuple):  # some torchvision models return namedtuples in train mode
                features = features[0]
            return F.normalize(self.embedding(features.flatten(1)).float(), dim=1)
        maps = self.taps(self.backbone, images)
        levels = [
            F.normalize(head(pool(m).flatten(1)).float(), dim=1)
            for m, pool, head in zip(maps, self.pools, self.embedding, strict=True)
        ]
        return torch.cat(levels, dim=1) / math.sqrt(len(levels))


def build_model(
    backbone: str,
    embedding_dim: int,
    weights: str | None = None,
    *,
    pooling: Pooling = "avg",
    gem_p: float = 3.0,
    multilevel: bool | Sequence[str] = False,
    image_size: int | None = None,
    backbone_kwargs: dict[str, Any] | None = None,
    download: bool = True,
) -> EmbeddingNet:
    """The embedding network on ``backbone`` (``resnet50``, ``timm:<name>``, ``open_clip:<name>``).

    weights: None (random init), named weights (torchvision weight names such as ``IMAGENET1K_V2`` or
        ``DEFAULT``; timm ``DEFAULT`` or a pretrained tag; open_clip pretrained tags such as ``openai``) —
        these download through the library's cache — or a local file: the backbone's own state dict (its
        classifier is ignored) or a whole dmltrain model / checkpoint, head included.
    pooling: ``gem`` replaces a CNN's global average pooling with learnable GeM (initial exponent gem_p).
    multilevel: True (three default depths) or feature names to tap: a multi-level embedding of
        ``embedding_dim / levels`` per level.
    image_size: the input side the data pipeline produces; fixed-size models (ViTs) are built for it.
    backbone_kwargs: passed to the library's constructor (e.g. timm ``drop_path_rate``).
    download: False builds named-weights models without their weights (configuration checks).
    """
    parsed = validate_backbone(backbone, weights)
    fam = family(parsed.kind)
    state = read_state_dict(weights) if is_weights_file(weights) else None  # type: ignore[arg-type]
    whole = state if state is not None and is_embedding_state(state) else None
    built = fam.create(
        parsed.name,
        None if state is not None else weights,
        None if whole is not None else state,
        image_size,
        dict(backbone_kwargs or {}),
        download,
        source=str(weights),
    )
    if multilevel:
        which = None if multilevel is True else list(multilevel)  # type: ignore[arg-type]
        tapped = fam.taps(built.module, which, backbone)
        pools = [GeM(gem_p) if pooling == "gem" else nn.AdaptiveAvgPool2d(1) for _ in tapped.channels]
        net = EmbeddingNet(
            tapped.module,
            tapped.channels,
            embedding_dim,
            taps=tapped.taps,
            pools=pools,
            tap_names=tapped.names,
        )
    else:
        if pooling == "gem":
            fam.use_gem(built.module, gem_p, backbone)
        net = EmbeddingNet(built.module, [built.feature_dim], embedding_dim)
    if whole is not None:
        try:
            net.load_state_dict(whole)
        except RuntimeError as exc:
            first = str(exc).strip().splitlines()[0]
            raise ValueError(
                f"model.weights={weights}: does not fit this model (a dmltrain model of another "
                f"architecture or embedding size: {first})"
            ) from None
    return net


def check_model(
    backbone: str, embedding_dim: int, weights: str | None = None, **options: Any
) -> EmbeddingNet:
    """Build the architecture on the meta device (no memory, no download) to catch configuration mistakes
    — unknown names, GeM or taps a backbone lacks, a local weights file that does not fit — up front."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter.*")
        return build_model(backbone, embedding_dim, weights, download=False, **options)


def parameter_groups(model: EmbeddingNet, lr: float, embedding_lr_mult: float) -> list[dict]:
    """Backbone at the base learning rate; the new embedding layer(s) at ``embedding_lr_mult`` times it;
    GeM exponents (if any) at the same faster rate and without weight decay, as Radenović et al. train p."""
    pool = pooling_parameters(model)
    pool_ids = {id(p) for p in pool}
    head_ids = {id(p) for p in model.embedding.parameters()}
    backbone = [p for p in model.parameters() if p.requires_grad and id(p) not in pool_ids | head_ids]
    groups = [
        {"params": backbone, "lr": lr, "name": "backbone"},
        {"params": list(model.embedding.parameters()), "lr": lr * embedding_lr_mult, "name": "embedding"},
    ]
    if pool:
        groups.append({"params": pool, "lr": lr * embedding_lr_mult, "weight_decay": 0.0, "name": "pooling"})
    return groups


def freeze_batchnorm(model: nn.Module) -> None:
    """Put every BatchNorm layer in eval mode (running statistics), as the papers' fine-tuning does."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()
