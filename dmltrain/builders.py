"""Turn validated config sections into training objects (optimizer, schedule).

Kept apart from the worker loop so the same construction serves training, resuming and tests.
"""

from __future__ import annotations

import math

import torch

from dmltrain.config import OptimConfig
from dmltrain.models import EmbeddingNet, parameter_groups


def build_optimizer(model: EmbeddingNet, cfg: OptimConfig) -> torch.optim.Optimizer:
    """Adam (FastAP, Smooth-AP) or SGD with momentum (RLL); the embedding layer at 10x the base rate."""
    groups = parameter_groups(model, cfg.lr, cfg.embedding_lr_mult)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.Adam(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)


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
