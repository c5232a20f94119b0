"""torchvision classification models as backbones (the papers' ResNet-50 / GoogLeNet set-ups)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torchvision
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

from dmltrain.models.common import Built, Tapped, is_weights_file
from dmltrain.models.pooling import GeM
from dmltrain.models.preprocessing import PreprocessConfig
from dmltrain.models.weights import StateDict, load_matching

# Constructor arguments some randomly initialised backbones need to drop their auxiliary classifiers.
_BACKBONE_KWARGS: dict[str, dict[str, object]] = {
    "googlenet": {"aux_logits": False, "init_weights": False},
    "inception_v3": {"aux_logits": False, "init_weights": False},
}
_AUX_PREFIXES = ("aux1.", "aux2.", "AuxLogits.")

# RLL's low/mid/high levels (inception-3c, 4e, 5b of BN-Inception) and their counterparts elsewhere.
_DEFAULT_TAPS = {
    "googlenet": ["inception3b", "inception4e", "inception5b"],
    "inception_v3": ["Mixed_5d", "Mixed_6e", "Mixed_7c"],
}
_RESNET_TAPS = ["layer2", "layer3", "layer4"]
_PROBE_SIZE = 128  # big enough for every CNN (inception_v3 needs 75 px), cheap for all


@dataclass(frozen=True)
class GraphTaps:
    """The backbone is a torchvision feature extractor returning ``{node: map}`` in tap order."""

    def __call__(self, backbone: nn.Module, images: torch.Tensor) -> list[torch.Tensor]:
        return list(backbone(images).values())


class TorchvisionFamily:
    def validate(self, name: str, weights: str | None, backbone: str) -> None:
        if name not in torchvision.models.list_models(module=torchvision.models):
            raise ValueError(
                f"model.backbone={backbone!r} is not a torchvision classification model; try one of "
                "resnet18, resnet50, googlenet, mobilenet_v2, efficientnet_b0, convnext_tiny, or a "
                "'timm:<name>' / 'open_clip:<name>' model"
            )
        if weights is not None and not is_weights_file(weights):
            self._named(name, weights)

    @staticmethod
    def _named(name: str, weights: str) -> Any:
        enum = torchvision.models.get_model_weights(name)
        try:
            return enum[weights.rsplit(".", 1)[-1]]
        except KeyError:
            options = [w.name for w in enum]
            raise ValueError(f"model.weights={weights!r}: {name} offers {[*options, 'DEFAULT']}") from None

    def preprocessing(self, name: str, weights: str | None, kwargs: dict[str, Any]) -> PreprocessConfig:
        entry = self._entry(name, weights)
        if entry is None:
            return PreprocessConfig(resolution=224, resize=256)
        t = entry.transforms()
        return PreprocessConfig(
            resolution=int(t.crop_size[0]),
            resize=int(t.resize_size[0]),
            mean=tuple(t.mean),
            std=tuple(t.std),
            interpolation=t.interpolation.value,
        )

    def _entry(self, name: str, weights: str | None) -> Any:
        """The weights entry describing these weights: by name; for a local file, the entry whose download
        has the same file name (torchvision's own files); otherwise the architecture's first entry."""
        try:
            entries = list(torchvision.models.get_model_weights(name))
        except (KeyError, ValueError):
            return None
        if weights is not None and not is_weights_file(weights):
            return self._named(name, weights)
        if weights is not None:
            for entry in entries:
                if Path(entry.url).name == Path(weights).name:
                    return entry
        return entries[0] if entries else None

    def create(
        self,
        name: str,
        weights: str | None,
        state: StateDict | None,
        image_size: int | None,
        kwargs: dict[str, Any],
        download: bool,
        source: str = "",
    ) -> Built:
        named = self._named(name, weights) if weights is not None and download else None
        # With named weights torchvision drops the auxiliary heads itself and refuses our overrides.
        extra = _BACKBONE_KWARGS.get(name, {}) if named is None else {}
        model = torchvision.models.get_model(name, weights=named, **{**extra, **kwargs})
        classifier, feature_dim = _strip_classifier(model, name)
        if state is not None:
            load_matching(model, state, source, ignore=(f"{classifier}.", *_AUX_PREFIXES))
        return Built(model, feature_dim)

    def use_gem(self, module: nn.Module, p: float, backbone: str) -> None:
        if not isinstance(getattr(module, "avgpool", None), nn.AdaptiveAvgPool2d):
            raise ValueError(
                f"model.pooling=gem: {backbone} has no `avgpool` module to replace (it pools inside forward "
                "or is not a CNN); GeM works with resnets, googlenet, efficientnets, regnets, convnexts, "
                "mobilenet_v3 and timm CNNs"
            )
        module.avgpool = GeM(p)

    def taps(self, module: nn.Module, which: list[str] | None, backbone: str) -> Tapped:
        nodes = which or _default_taps(module, backbone)
        _, eval_nodes = get_graph_node_names(module)
        unknown = [n for n in nodes if not any(e == n or e.startswith(n + ".") for e in eval_nodes)]
        if unknown:
            raise ValueError(
                f"model.multilevel: {unknown} are not nodes of {backbone} (see torchvision.models."
                f"feature_extraction.get_graph_node_names); e.g. {eval_nodes[-8:]}"
            )
        extractor = create_feature_extractor(module, return_nodes={n: n for n in nodes})
        channels = _probe_channels(extractor, nodes, backbone)
        return Tapped(extractor, GraphTaps(), channels, list(nodes))


def _default_taps(module: nn.Module, backbone: str) -> list[str]:
    if backbone in _DEFAULT_TAPS:
        return _DEFAULT_TAPS[backbone]
    if all(hasattr(module, layer) for layer in _RESNET_TAPS):
        return _RESNET_TAPS
    raise ValueError(
        f"model.multilevel: no default levels for {backbone}; list the node names to tap, e.g. "
        f"model.multilevel=[features.4,features.6,features.8] (torchvision.models.feature_extraction."
        "get_graph_node_names lists them)"
    )


@torch.no_grad()
def _probe_channels(extractor: nn.Module, nodes: list[str], backbone: str) -> list[int]:
    """Channels of each tapped map, from one tiny forward (on the meta device when building a check)."""
    device = next(extractor.parameters()).device
    was_training = extractor.training
    extractor.eval()
    try:
        maps = extractor(torch.zeros(1, 3, _PROBE_SIZE, _PROBE_SIZE, device=device))
    finally:
        extractor.train(was_training)
    channels = []
    for node in nodes:
        out = maps[node]
        if not isinstance(out, torch.Tensor) or out.dim() != 4:
            raise ValueError(
                f"model.multilevel: node {node!r} of {backbone} is not a (B, C, H, W) feature map"
            )
        channels.append(int(out.shape[1]))
    return channels


def _strip_classifier(model: nn.Module, name: str) -> tuple[str, int]:
    """Replace the last ``nn.Linear`` (the ImageNet classifier) with Identity; return its path and input size.

    torchvision names the classifier differently per family (fc, classifier, heads.head, ...), but it is
    always the last Linear layer registered, which makes this work for resnets, googlenet, mobilenets,
    efficientnets, convnexts, regnets, densenets and vits alike.
    """
    last: tuple[str, nn.Linear] | None = None
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not module_name.startswith(("aux1", "aux2", "AuxLogits")):
            last = (module_name, module)
    if last is None:
        raise ValueError(f"model.backbone={name!r}: no Linear classifier found to replace")
    path, linear = last
    parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
    setattr(parent, path.rsplit(".", 1)[-1], nn.Identity())
    return path, linear.in_features
