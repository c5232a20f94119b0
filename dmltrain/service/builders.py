"""Turn validated config sections into training objects (loss, optimizer, schedules).

Kept apart from the worker loop so the same construction serves training, resuming and tests.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dmltrain.data.transforms import Transform, test_transform
from dmltrain.losses import FastAPLoss, RankedListLoss, RankingLoss, SmoothAPLoss, TnSchedule, TripletLoss
from dmltrain.models import EmbeddingNet, build_model, parameter_groups
from dmltrain.service.config import (
    ExperimentConfig,
    FastAPConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    RankedListConfig,
    SmoothAPConfig,
)

_FUSED_DEVICES = ("cpu", "cuda")
_IMPLEMENTATION_FLAGS = ("fused", "foreach")


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
    """Load a checkpointed optimizer state but keep this run's implementation (fused / foreach).

    torch restores those flags from the saved parameter groups, so a checkpoint written before fusing
    would otherwise switch the resumed run back to the slow loop.
    """
    current = [{k: g[k] for k in _IMPLEMENTATION_FLAGS if k in g} for g in optimizer.param_groups]
    saved_groups = state.get("param_groups", [])
    if len(saved_groups) == len(current):
        state = {**state, "param_groups": [{**g, **c} for g, c in zip(saved_groups, current, strict=True)]}
    optimizer.load_state_dict(state)


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


def build_loss(cfg: LossConfig) -> RankingLoss:
    """The configured ranking loss with the papers' argument names and the memory budgets."""
    memory = {"memory_budget_mb": cfg.memory_budget_mb, "saved_budget_mb": cfg.saved_budget_mb}
    if isinstance(cfg, FastAPConfig):
        return FastAPLoss(num_bins=cfg.num_bins, **memory)
    if isinstance(cfg, SmoothAPConfig):
        return SmoothAPLoss(temperature=cfg.temperature, **memory)
    if isinstance(cfg, RankedListConfig):
        return RankedListLoss(
            margin=cfg.margin,
            alpha=cfg.alpha,
            tn=cfg.tn,
            tp=cfg.tp,
            lam=cfg.lam,
            gradient=cfg.gradient,
            **memory,
        )
    return TripletLoss(margin=cfg.margin, triplets=cfg.triplets, **memory)


def build_tn_schedule(cfg: LossConfig, loss: RankingLoss) -> TnSchedule | None:
    """RLL's dynamic Tn (Eq. 15) when the config asks for one; it drives ``loss.tn`` as it steps."""
    if isinstance(cfg, RankedListConfig) and cfg.tn_schedule is not None:
        assert isinstance(loss, RankedListLoss)
        return TnSchedule(loss, cfg.tn_schedule.start, cfg.tn_schedule.end, cfg.tn_schedule.steps)
    return None


def build_test_transform(config: ExperimentConfig) -> Transform:
    """The test-time resize + centre crop of a run: evaluation, the served MLflow model and `dmltrain index`
    all take it from here, so they see images exactly alike."""
    return test_transform(config.data.image_size, config.data.resize, config.data.resize_mode)


def build_network(config: ModelConfig, pretrained: bool = True) -> EmbeddingNet:
    """The run's embedding network; ``pretrained=False`` builds the architecture only (no weight download),
    for loading a trained model file into it (evaluation, serving, indexing)."""
    return build_model(config.backbone, config.embedding_dim, config.weights if pretrained else None)
