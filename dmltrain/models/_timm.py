"""timm models as backbones (``timm:<name>``): DINOv2 / CLIP ViTs, ConvNeXt, EfficientNet and the rest."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dmltrain.models.common import Built, Tapped, is_weights_file, require
from dmltrain.models.pooling import GeM
from dmltrain.models.preprocessing import INTERPOLATIONS, PreprocessConfig
from dmltrain.models.weights import StateDict, load_matching

log = logging.getLogger("dmltrain.models")

# `model.weights` values that mean "timm's default pretrained weights of this architecture".
DEFAULT_WEIGHTS = ("DEFAULT", "pretrained")


def _timm(backbone: str) -> Any:
    return require("timm", "timm", backbone)


@dataclass(frozen=True)
class IntermediateTaps:
    """timm's ``forward_intermediates``: maps after the feature stages at ``indices`` (NCHW)."""

    indices: tuple[int, ...]

    def __call__(self, backbone: nn.Module, images: torch.Tensor) -> list[torch.Tensor]:
        return backbone.forward_intermediates(images, indices=list(self.indices), intermediates_only=True)


class TimmFamily:
    def _qualified(self, name: str, weights: str | None, backbone: str) -> tuple[str, bool]:
        """``arch[.tag]`` to instantiate and whether named (downloadable) weights were asked for."""
        if weights is None or is_weights_file(weights):
            return name, False
        timm = _timm(backbone)
        arch, _, tag = name.partition(".")
        if weights in DEFAULT_WEIGHTS:
            if not timm.list_pretrained(f"{arch}.*") and not timm.list_pretrained(arch):
                raise ValueError(f"model.weights={weights!r}: timm has no pretrained weights for {arch}")
            return name, True
        if tag:
            raise ValueError(
                f"model.weights={weights!r}: {backbone!r} already names the tag {tag!r}; use weights: DEFAULT"
            )
        qualified = f"{arch}.{weights}"
        if qualified not in timm.list_pretrained(f"{arch}.*"):
            tags = [t.partition(".")[2] for t in timm.list_pretrained(f"{arch}.*")]
            raise ValueError(f"model.weights={weights!r}: timm's {arch} offers {[*DEFAULT_WEIGHTS, *tags]}")
        return qualified, True

    def validate(self, name: str, weights: str | None, backbone: str) -> None:
        timm = _timm(backbone)
        if not timm.is_model(name):
            close = timm.list_models(f"*{name.partition('.')[0][:6]}*")[:6]
            raise ValueError(f"model.backbone={backbone!r} is not a timm model (similar: {close})")
        self._qualified(name, weights, backbone)

    def preprocessing(self, name: str, weights: str | None, kwargs: dict[str, Any]) -> PreprocessConfig:
        timm = _timm(f"timm:{name}")
        qualified, _ = self._qualified(name, weights, f"timm:{name}")
        cfg = timm.models.get_pretrained_cfg(qualified)
        data = timm.data.resolve_data_config(args={}, pretrained_cfg=cfg.to_dict() if cfg else {})
        size = kwargs.get("img_size") or data["input_size"][-2:]
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        if height != width:
            raise ValueError(
                f"model.backbone=timm:{name}: only square inputs are supported, got {height}x{width}"
            )
        interpolation = data.get("interpolation", "bicubic")
        return PreprocessConfig.from_crop_pct(
            int(height),
            float(data.get("crop_pct") or 1.0),
            mean=tuple(data["mean"]),
            std=tuple(data["std"]),
            interpolation=interpolation if interpolation in INTERPOLATIONS else "bicubic",
            crop_mode="squash" if data.get("crop_mode") == "squash" else "center",
        )

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
        backbone = f"timm:{name}"
        timm = _timm(backbone)
        qualified, named = self._qualified(name, weights, backbone)
        kw = dict(kwargs)
        cfg = timm.models.get_pretrained_cfg(qualified)
        # ViTs are built for one input size: build them for the configured one (timm resamples the
        # position embeddings of loaded weights to it).
        fixed = cfg is not None and cfg.fixed_input_size and "img_size" not in kw
        if fixed and image_size and image_size != cfg.input_size[-1]:
            kw["img_size"] = image_size
        model = timm.create_model(qualified, pretrained=named and download, num_classes=0, **kw)
        if state is not None:
            _load_file(timm, model, state, source)
        feature_dim = int(getattr(model, "head_hidden_size", None) or model.num_features)
        return Built(model, feature_dim)

    def use_gem(self, module: nn.Module, p: float, backbone: str) -> None:
        from timm.layers import SelectAdaptivePool2d

        pools = [m for m in module.modules() if isinstance(m, SelectAdaptivePool2d)]
        if len(pools) != 1 or not isinstance(pools[0].pool, nn.AdaptiveAvgPool2d):
            raise ValueError(
                f"model.pooling=gem: {backbone} has no single global average pool to replace "
                "(transformers pool with a class token or attention); use model.pooling=avg"
            )
        pools[0].pool = GeM(p)

    def taps(self, module: nn.Module, which: list[str] | None, backbone: str) -> Tapped:
        info = list(getattr(module, "feature_info", []) or [])
        if not info or not hasattr(module, "forward_intermediates"):
            raise ValueError(f"model.multilevel: {backbone} does not expose intermediate features in timm")
        names = [f["module"] for f in info]
        if which:
            unknown = [n for n in which if n not in names]
            if unknown:
                raise ValueError(f"model.multilevel: {unknown} are not feature stages of {backbone}: {names}")
            indices = [names.index(n) for n in which]
        else:
            if len(names) < 3:
                raise ValueError(f"model.multilevel: {backbone} has fewer than 3 feature stages ({names})")
            indices = list(range(len(names) - 3, len(names)))
        if sorted(set(indices)) != indices:
            raise ValueError(f"model.multilevel: list distinct stages shallow to deep, got {which}")
        # Drop the layers past the deepest tap (and the head), so every parameter takes part in training.
        module.prune_intermediate_layers(indices, prune_norm=True, prune_head=True)
        channels = [int(info[i]["num_chs"]) for i in indices]
        return Tapped(module, IntermediateTaps(tuple(indices)), channels, [names[i] for i in indices])


def _load_file(timm: Any, model: nn.Module, state: StateDict, source: str) -> None:
    """Load a local file: timm's own layout (through the model's checkpoint filter, which converts the
    original DINOv2/ConvNeXt/... layouts and resamples ViT position embeddings), or, when the names differ
    but the tensors line up in order and shape (e.g. the EfficientNet-PyTorch layout), mapped by position."""
    filter_fn = getattr(sys.modules[type(model).__module__], "checkpoint_filter_fn", None)
    if filter_fn is not None:
        try:
            state = filter_fn(dict(state), model)
        except Exception as exc:  # a foreign layout the filter does not know: try the names as they are
            log.debug(
                "checkpoint_filter_fn of %s failed (%s); using the file's names", type(model).__name__, exc
            )
    classifier = model.pretrained_cfg.get("classifier") or ()
    ignore = tuple(f"{c}." for c in ([classifier] if isinstance(classifier, str) else classifier))
    try:
        load_matching(model, state, source, ignore=ignore)
        return
    except ValueError as by_name:
        remapped = _by_position(timm, model, state)
        if remapped is None:
            raise by_name from None
    log.warning("model.weights=%s: parameter names differ from timm's; mapped by position and shape", source)
    model.load_state_dict(remapped)


def _by_position(timm: Any, model: nn.Module, state: StateDict) -> StateDict | None:
    """The file's tensors renamed to the model's, if they match one to one in order and shape once a
    trailing classifier (a 2-D weight and its bias) is set aside; None otherwise."""
    own = model.state_dict()
    items = list(state.items())
    if len(items) == len(own) + 2 and items[-2][1].dim() == 2 and items[-1][1].dim() == 1:
        items = items[:-2]
    if len(items) != len(own):
        return None
    if any(v.shape != o.shape for (_, v), o in zip(items, own.values(), strict=True)):
        return None
    return timm.models.remap_state_dict(dict(items), model, allow_reshape=False)
