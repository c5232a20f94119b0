"""Generalized-mean (GeM) pooling, Radenović, Tolias & Chum, "Fine-tuning CNN Image Retrieval with No
Human Annotation" (TPAMI 2018): ``f_c = (mean_hw x_chw^p)^(1/p)`` with a learnable p.

p = 1 is average pooling and p -> inf max pooling; learning p lets retrieval fine-tuning pick how much the
strongest activations dominate. It assumes non-negative activations (the output of a ReLU-family CNN):
inputs are clamped at ``eps`` first, as in the paper's code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GeM(nn.Module):
    """(B, C, H, W) -> (B, C, 1, 1), a drop-in replacement for ``nn.AdaptiveAvgPool2d(1)``."""

    def __init__(self, p: float = 3.0, eps: float = 1e-6) -> None:
        super().__init__()
        if not p > 0:
            raise ValueError(f"GeM p must be positive, got {p}")
        self.p = nn.Parameter(torch.tensor(float(p)))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The power runs in float32 even under autocast: x^p of fp16/bf16 activations overflows quickly.
        p = self.p.float()
        pooled = F.adaptive_avg_pool2d(x.float().clamp(min=self.eps).pow(p), 1)
        return pooled.pow(1.0 / p).to(x.dtype)

    def extra_repr(self) -> str:
        return f"p={float(self.p.detach()):.3f}, eps={self.eps}"


def pooling_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every GeM exponent in ``model`` (they get their own optimizer group, without weight decay)."""
    return [m.p for m in model.modules() if isinstance(m, GeM)]
