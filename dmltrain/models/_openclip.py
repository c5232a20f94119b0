"""open_clip image towers as backbones (``open_clip:<name>``, e.g. ``open_clip:ViT-B-32``).

The tower keeps CLIP's own projection (its output is the image embedding CLIP was trained to align with
text); the text tower is built by open_clip and dropped. Named weights are open_clip's pretrained tags
(``openai``, ``laion2b_s34b_b79k``, ...); a local file is a full open_clip checkpoint (``visual.*`` keys,
e.g. ``open_clip_pytorch_model.bin``) or a state dict of the image tower alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dmltrain.models.common import Built, Tapped, is_weights_file, require
from dmltrain.models.preprocessing import INTERPOLATIONS, PreprocessConfig
from dmltrain.models.weights import StateDict, load_matching


def _open_clip(backbone: str) -> Any:
    return require("open_clip", "openclip", backbone)


class OpenClipFamily:
    def validate(self, name: str, weights: str | None, backbone: str) -> None:
        open_clip = _open_clip(backbone)
        if name not in open_clip.list_models():
            close = [m for m in open_clip.list_models() if name.split("-")[0].lower() in m.lower()][:6]
            raise ValueError(f"model.backbone={backbone!r} is not an open_clip model (similar: {close})")
        if weights is not None and not is_weights_file(weights):
            tags = open_clip.list_pretrained_tags_by_model(name)
            if weights not in tags:
                raise ValueError(f"model.weights={weights!r}: open_clip's {name} offers the tags {tags}")

    def _tag(self, weights: str | None) -> str | None:
        return None if weights is None or is_weights_file(weights) else weights

    def preprocessing(self, name: str, weights: str | None, kwargs: dict[str, Any]) -> PreprocessConfig:
        open_clip = _open_clip(f"open_clip:{name}")
        model_cfg = open_clip.get_model_config(name)
        settings: dict[str, Any] = {
            "mean": open_clip.OPENAI_DATASET_MEAN,
            "std": open_clip.OPENAI_DATASET_STD,
            "interpolation": "bicubic",
            "resize_mode": "shortest",
        }
        settings.update(model_cfg.get("preprocess_cfg", {}))
        tag = self._tag(weights)
        if tag is not None:
            pretrained = open_clip.get_pretrained_cfg(name, tag)
            settings.update({k: pretrained[k] for k in settings if k in pretrained})
        settings.update(kwargs.get("force_preprocess_cfg") or {})
        size = kwargs.get("force_image_size") or model_cfg["vision_cfg"].get("image_size", 224)
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        if height != width:
            raise ValueError(f"model.backbone=open_clip:{name}: only square inputs are supported")
        mode = settings["resize_mode"]
        if mode not in ("shortest", "squash"):
            raise ValueError(
                f"model.backbone=open_clip:{name}: resize_mode {mode!r} (letterbox padding) is not supported"
            )
        interpolation = settings["interpolation"]
        return PreprocessConfig(
            resolution=int(height),
            resize=int(height),
            mean=tuple(settings["mean"]),
            std=tuple(settings["std"]),
            interpolation=interpolation if interpolation in INTERPOLATIONS else "bicubic",
            crop_mode="squash" if mode == "squash" else "center",
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
        backbone = f"open_clip:{name}"
        open_clip = _open_clip(backbone)
        model_cfg = open_clip.get_model_config(name)
        kw = dict(kwargs)
        kw.pop("force_preprocess_cfg", None)  # preprocessing is ours (preprocessing_for), not the model's
        if (
            image_size
            and "force_image_size" not in kw
            and image_size != model_cfg["vision_cfg"].get("image_size")
        ):
            kw["force_image_size"] = image_size
        tag = self._tag(weights) if download else None
        if tag is not None and open_clip.get_pretrained_cfg(name, tag).get("quick_gelu", False):
            kw.setdefault("force_quick_gelu", True)  # e.g. OpenAI's weights were trained with QuickGELU
        clip = open_clip.create_model(name, pretrained=tag, device=torch.get_default_device(), **kw)
        visual: nn.Module = clip.visual
        if state is not None:
            if any(k.startswith("visual.") for k in state):
                state = {k: v for k, v in state.items() if k.startswith("visual.")}
                open_clip.model.resize_pos_embed(state, clip)  # in place, when the image size differs
                state = {k[len("visual.") :]: v for k, v in state.items()}
            load_matching(visual, state, source)
        del clip
        return Built(visual, int(model_cfg["embed_dim"]))

    def use_gem(self, module: nn.Module, p: float, backbone: str) -> None:
        raise ValueError(
            f"model.pooling=gem: {backbone} pools itself (class token or attention pooling); use avg"
        )

    def taps(self, module: nn.Module, which: list[str] | None, backbone: str) -> Tapped:
        raise ValueError(
            f"model.multilevel: not available for open_clip towers ({backbone}); use a torchvision/timm CNN"
        )
