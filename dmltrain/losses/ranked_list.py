"""Ranked List Loss (Wang et al.): Eq. 8-14, RLL-Simpler (Sec. 3.4) and the dynamic Tn of Eq. 15.

Distances are plain Euclidean ``||x_i - x_j||``. Mined sets: positives with ``d > alpha - margin`` and
negatives with ``d < alpha``; each set's pairs are weighted by ``exp(T (violation))`` normalised over the set
(Eq. 9-12). The weights are constants for the gradient (computed from detached distances) while both
embeddings of every pair receive gradient, as DESIGN.md specifies. (The paper's Sec. 3.2 remark treats the
gallery features as constants; dmltrain deliberately differs so the global-batch gradient is symmetric.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from dmltrain.losses._rowwise import BlockResult, QueryBlock
from dmltrain.losses.base import DEFAULT_MEMORY_BUDGET_MB, RankingLoss

# Distances below this are treated as coincident points: direction undefined, no gradient through the sqrt.
_MIN_DISTANCE = 1e-12


def _normalised_weights(active: Tensor, logits: Tensor) -> Tensor:
    """exp(logits) over the active entries of each row, normalised to sum 1 (all-zero rows stay 0)."""
    masked = torch.where(active, logits, float("-inf"))
    top = masked.amax(dim=1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, 0.0)
    w = torch.exp(masked - top)  # max-shifted: identical ratios, no overflow for large temperatures
    total = w.sum(dim=1, keepdim=True)
    return w / torch.where(total > 0, total, 1.0)


class _RankedListKernel:
    metric = "sqeuclidean"
    needs_positive_sets = False

    def __init__(self, margin: float, alpha: float, tn: float, tp: float, lam: float) -> None:
        self.margin, self.alpha, self.tn, self.tp, self.lam = margin, alpha, tn, tp, lam

    def __call__(self, block: QueryBlock) -> BlockResult:
        alpha, pos_boundary = self.alpha, self.alpha - self.margin
        dist = block.values.sqrt()
        same = block.same_label()
        pos = same.clone()
        block.zero_self(pos)
        pos_star = pos & (dist > pos_boundary)  # Eq. P*_{c,i}
        neg_star = ~same & (dist < alpha)  # Eq. N*_{c,i}
        w_pos = _normalised_weights(pos_star, self.tp * (dist - pos_boundary))  # Eq. 10, normalised as in 11
        w_neg = _normalised_weights(neg_star, self.tn * (alpha - dist))  # Eq. 9, normalised as in 12
        loss_pos = (w_pos * (dist - pos_boundary)).sum(1)  # Eq. 11
        loss_neg = (w_neg * (alpha - dist)).sum(1)  # Eq. 12
        terms = (1.0 - self.lam) * loss_pos + self.lam * loss_neg  # Eq. 13
        valid = (pos_star | neg_star).any(1)
        if block.jacobian is not None:
            grad_dist = (1.0 - self.lam) * w_pos - self.lam * w_neg
            # d dist / d dist^2 = 1 / (2 dist); the kernel's values are squared distances.
            far = dist > _MIN_DISTANCE
            block.jacobian.copy_(torch.where(far, grad_dist * 0.5 / torch.where(far, dist, 1.0), 0.0))
        count = torch.tensor(float(terms.shape[0]), dtype=torch.float64, device=terms.device)
        return BlockResult(terms=terms, count=count, valid=valid)


class RankedListLoss(RankingLoss):
    """Ranked List Loss ``mean over all queries of (1 - lam) L_P + lam L_N`` (Eq. 13-14).

    Why: RLL pushes each query's negatives beyond ``alpha`` and pulls its positives within
    ``alpha - margin`` with set-wise weighted hinges. ``alpha=None`` is RLL-Simpler:
    ``alpha = 1 + margin / 2``.
    ``tn`` may be changed between steps (see `TnSchedule`, Eq. 15).

    ``reduction="none"`` gives each query's ``L_RLL`` (an empty mined set contributes 0); ``parts().count``
    is the number of queries and ``num_valid`` the number of queries with at least one mined pair.
    """

    def __init__(
        self,
        margin: float = 0.4,
        alpha: float | None = None,
        tn: float = 10.0,
        tp: float = 0.0,
        lam: float = 0.5,
        *,
        memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB,
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb)
        for name, value in (("margin", margin), ("tn", tn), ("tp", tp), ("lam", lam)):
            _require_finite(name, value)
        if alpha is not None:
            _require_finite("alpha", alpha)
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must lie in [0, 1], got {lam!r}")
        self.margin = float(margin)
        self.alpha = None if alpha is None else float(alpha)
        self.tn = float(tn)
        self.tp = float(tp)
        self.lam = float(lam)

    @property
    def effective_alpha(self) -> float:
        """``alpha``, or RLL-Simpler's ``1 + margin / 2`` when it was left as None."""
        return 1.0 + self.margin / 2.0 if self.alpha is None else self.alpha

    def _kernel(self) -> _RankedListKernel:
        _require_finite("tn", self.tn)
        return _RankedListKernel(self.margin, self.effective_alpha, self.tn, self.tp, self.lam)

    def extra_repr(self) -> str:
        return (
            f"margin={self.margin}, alpha={self.alpha} (effective {self.effective_alpha}), "
            f"tn={self.tn}, tp={self.tp}, lam={self.lam}"
        )


class TnSchedule:
    """Dynamic negative temperature of RLL Eq. 15: ``Tn = T1 - cur_iter * (T1 - T2) / max_iter``.

    Why an object: the trainer steps it once per optimisation step (like an LR scheduler) and checkpoints it
    with ``state_dict()``. Construction sets ``loss.tn = t1``; each ``step()`` advances ``cur_iter`` and
    writes the new value into ``loss.tn``; after ``max_iter`` steps Tn stays at ``t2``.
    """

    def __init__(self, loss: RankedListLoss, t1: float, t2: float, max_iter: int) -> None:
        _require_finite("t1", t1)
        _require_finite("t2", t2)
        if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
            raise ValueError(f"max_iter must be a positive integer, got {max_iter!r}")
        self.loss = loss
        self.t1, self.t2, self.max_iter = float(t1), float(t2), max_iter
        self.cur_iter = 0
        self.loss.tn = self.value()

    def value(self, cur_iter: int | None = None) -> float:
        """Tn at ``cur_iter`` (default: the current iteration), clamped to ``t2`` past ``max_iter``."""
        it = min(self.cur_iter if cur_iter is None else cur_iter, self.max_iter)
        return self.t1 - it * (self.t1 - self.t2) / self.max_iter

    def step(self) -> float:
        """Advance one iteration, update ``loss.tn`` and return the new Tn."""
        self.cur_iter += 1
        self.loss.tn = self.value()
        return self.loss.tn

    def state_dict(self) -> dict[str, Any]:
        return {"t1": self.t1, "t2": self.t2, "max_iter": self.max_iter, "cur_iter": self.cur_iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed schedule and re-apply its Tn to the loss."""
        self.t1, self.t2 = float(state["t1"]), float(state["t2"])
        self.max_iter, self.cur_iter = int(state["max_iter"]), int(state["cur_iter"])
        self.loss.tn = self.value()


def _require_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
