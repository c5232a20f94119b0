"""Turn validated config sections into training objects (loss, optimizer, schedules).

Kept apart from the worker loop so the same construction serves training, resuming and tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dmltrain.data.transforms import Transform
from dmltrain.losses import (
    FastAPLoss,
    LevelwiseLoss,
    RankedListLoss,
    RankingLoss,
    SmoothAPLoss,
    TnSchedule,
    TripletLoss,
)
from dmltrain.models import (
    EmbeddingNet,
    PreprocessConfig,
    build_model,
    check_model,
    is_weights_file,
    parameter_groups,
    preprocessing_for,
)
from dmltrain.models.preprocessing import CROP_MODE_OF_RESIZE
from dmltrain.service.config import (
    ExperimentConfig,
    FastAPConfig,
    LossConfig,
    OptimConfig,
    RankedListConfig,
    SmoothAPConfig,
)

_FUSED_DEVICES = ("cpu", "cuda")


def resolve_preprocessing(config: ExperimentConfig) -> PreprocessConfig:
    """The backbone's own preprocessing (dmltrain.models.preprocessing_for) with the ``data.*`` overrides:
    ``image_size``, ``resize``, ``resize_mode``, ``mean``, ``std``, ``interpolation``. Training, evaluation
    and the saved model all use this one value."""
    model, data = config.model, config.data
    base = preprocessing_for(model.backbone, model.weights, model.backbone_kwargs)
    crop_mode = None if data.resize_mode is None else CROP_MODE_OF_RESIZE[data.resize_mode]
    return base.with_overrides(
        resolution=data.image_size,
        resize=data.resize,
        mean=data.mean,
        std=data.std,
        interpolation=data.interpolation,
        crop_mode=crop_mode,
    )


def _model_options(config: ExperimentConfig, preprocessing: PreprocessConfig) -> dict:
    m = config.model
    return {
        "pooling": m.pooling,
        "gem_p": m.gem_p,
        "multilevel": m.multilevel,
        "image_size": preprocessing.resolution,
        "backbone_kwargs": m.backbone_kwargs,
    }


def build_network(
    config: ExperimentConfig, preprocessing: PreprocessConfig | None = None, *, pretrained: bool = True
) -> EmbeddingNet:
    """The configured embedding network. ``pretrained=False`` builds the same architecture without reading
    ``model.weights`` (named weights are not downloaded, a local file is not read): for loading a trained
    model's state dict into it (evaluation, serving, indexing)."""
    m = config.model
    preprocessing = preprocessing or resolve_preprocessing(config)
    weights = None if not pretrained and is_weights_file(m.weights) else m.weights
    return build_model(
        m.backbone,
        m.embedding_dim,
        weights,
        download=pretrained,
        **_model_options(config, preprocessing),
    )


def check_network(config: ExperimentConfig) -> tuple[PreprocessConfig, int]:
    """Resolve the preprocessing and build the network on the meta device (a local weights file is read
    and matched): every model mistake surfaces here, before any worker starts. Returns the preprocessing
    and the number of embedding levels."""
    preprocessing = resolve_preprocessing(config)
    m = config.model
    net = check_model(m.backbone, m.embedding_dim, m.weights, **_model_options(config, preprocessing))
    return preprocessing, net.levels


def build_optimizer(model: EmbeddingNet, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Adam (FastAP, Smooth-AP) or SGD with momentum (RLL); the embedding layer at 10x the base rate.

    The fused implementation (one multi-tensor kernel per step) is used where torch has it: on one CPU
    thread it updates resnet18's 11.7M parameters in ~12 ms against ~110 ms for the default per-parameter
    loop, the same numbers to float rounding (bench/service.py); every rank runs this update each step.
    """
    groups = parameter_groups(model, cfg.lr, cfg.embedding_lr_mult)
    fused = _can_fuse([p for g in groups for p in g["params"]])
    if cfg.name == "sgd":
        return torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=fused
        )
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.Adam(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)


def _can_fuse(params: list[torch.Tensor]) -> bool | None:
    """True when every parameter is a floating-point tensor on one CPU or CUDA device, else None (torch's
    default choice)."""
    devices = {p.device for p in params}
    if len(devices) != 1 or next(iter(devices)).type not in _FUSED_DEVICES:
        return None
    return True if all(p.is_floating_point() for p in params) else None


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpointed optimizer state (moments, step counts) but keep this run's group settings.

    torch would restore them from the checkpoint: the implementation (fused / foreach; a checkpoint
    written before fusing would switch the resumed run back to the slow loop) and the hyperparameters (lr,
    weight decay, momentum, betas), which a ``run.resume=must`` relaunch changes on purpose. The learning
    rate of the step itself is the scheduler's to set (`restore_schedule`).
    """
    current = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    saved_groups = state.get("param_groups", [])
    if len(saved_groups) == len(current):
        state = {**state, "param_groups": [{**g, **c} for g, c in zip(saved_groups, current, strict=True)]}
    optimizer.load_state_dict(state)


def restore_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict[str, Any]) -> None:
    """Continue a checkpointed schedule at its step with this run's base rates and shape: a relaunch with
    another ``optim.lr`` (``run.resume=must``) or ``train.steps`` (a cosine decay then spans the new length)
    trains with what it says from its first step on, not with the checkpoint's rates."""
    base_lrs = list(scheduler.base_lrs)
    scheduler.load_state_dict(state)
    scheduler.base_lrs = base_lrs
    step = scheduler.last_epoch
    for group, base, factor in zip(
        scheduler.optimizer.param_groups, base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(step)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # get_last_lr()


def lr_factor(cfg: OptimConfig, total_steps: int, step: int) -> float:
    """Multiplier of every group's base rate after ``step`` optimizer steps: linear warm-up, then decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "cosine":
        span = max(1, total_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if cfg.schedule == "step":
        return cfg.step_gamma ** ((step - cfg.warmup_steps) // cfg.step_every)
    return 1.0


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(cfg, total_steps, step))


def build_loss(cfg: LossConfig, levels: int = 1) -> nn.Module:
    """The configured ranking loss with the papers' argument names and the memory budgets; with a
    multi-level embedding (``levels`` > 1) one such loss per level, averaged (RLL Sec. 4.1.3)."""
    memory = {"memory_budget_mb": cfg.memory_budget_mb, "saved_budget_mb": cfg.saved_budget_mb}
    loss: RankingLoss
    if isinstance(cfg, FastAPConfig):
        loss = FastAPLoss(num_bins=cfg.num_bins, **memory)
    elif isinstance(cfg, SmoothAPConfig):
        loss = SmoothAPLoss(temperature=cfg.temperature, **memory)
    elif isinstance(cfg, RankedListConfig):
        loss = RankedListLoss(
            margin=cfg.margin,
            alpha=cfg.alpha,
            tn=cfg.tn,
            tp=cfg.tp,
            lam=cfg.lam,
            gradient=cfg.gradient,
            **memory,
        )
    else:
        loss = TripletLoss(margin=cfg.margin, triplets=cfg.triplets, **memory)
    return LevelwiseLoss(loss, levels) if levels > 1 else loss


def build_tn_schedule(cfg: LossConfig, loss: nn.Module) -> TnSchedule | None:
    """RLL's dynamic Tn (Eq. 15) when the config asks for one; it drives ``loss.tn`` as it steps."""
    if isinstance(cfg, RankedListConfig) and cfg.tn_schedule is not None:
        base = loss.base if isinstance(loss, LevelwiseLoss) else loss
        assert isinstance(base, RankedListLoss)
        return TnSchedule(base, cfg.tn_schedule.start, cfg.tn_schedule.end, cfg.tn_schedule.steps)
    return None


def build_train_transform(
    config: ExperimentConfig, preprocessing: PreprocessConfig | None = None
) -> Transform:
    """The run's training augmentation: the backbone's preprocessing with random resized crops (after the
    papers' warp in ``warp`` mode) and, unless ``data.flip`` is off, a horizontal flip."""
    return (preprocessing or resolve_preprocessing(config)).train_transform(
        config.data.crop_scale, flip=config.data.flip
    )


def build_test_transform(
    config: ExperimentConfig, preprocessing: PreprocessConfig | None = None
) -> Transform:
    """The test-time resize + centre crop of a run: evaluation, the served MLflow model and `dmltrain index`
    all take it from here, so they see images exactly alike."""
    return (preprocessing or resolve_preprocessing(config)).test_transform()
