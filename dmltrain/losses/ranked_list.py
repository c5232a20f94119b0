"""Ranked List Loss (Wang et al.): Eq. 8-14, RLL-Simpler (Sec. 3.4) and the dynamic Tn of Eq. 15.

Distances are plain Euclidean ``||x_i - x_j||``. Mined sets: positives with ``d > alpha - margin`` and
negatives with ``d < alpha``; each set's pairs are weighted by ``exp(T (violation))`` normalised over the set
(Eq. 9-12). The weights are constants for the gradient (computed from detached distances).

Which embeddings receive gradient is a choice (``gradient=``):
- ``"both"`` (default, DESIGN.md): both embeddings of every pair, the gradient of the batch loss (Eq. 14)
  with the weights held constant;
- ``"query"``: the paper's Sec. 3.2 form, "in the ranked list of x_i, we regard the features of other
  examples as constants": each query's term moves only the query's own embedding. Besides following the
  paper, it lets the distributed engine skip the all-reduce of the gathered-matrix gradient
  (`gallery_is_constant`), since a rank's rows then get gradient from that rank's queries alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from dmltrain.losses._rowwise import BlockResult, QueryBlock, add_at_columns
from dmltrain.losses._streamed import ColumnTile, RowGroup
from dmltrain.losses.base import RankingLoss

# Distances below this are treated as coincident points: direction undefined, no gradient through the sqrt.
_MIN_DISTANCE = 1e-12
# exp() arguments are kept >= -80: e^-80 is ~1e-35 of the largest weight (nothing in float32 sums) and exp
# of very negative float32 numbers takes a slow underflow path on CPU (over 100x slower).
_MIN_EXPONENT = -80.0

RLLGradient = Literal["both", "query"]
RLL_GRADIENTS: tuple[RLLGradient, ...] = ("both", "query")


def _set_weights(active: Tensor, logits: Tensor, bound: float | None) -> tuple[Tensor, Tensor]:
    """Eq. 9/10 weights exp(logits) on the active entries of each row (0 elsewhere) and 1 / their row sum
    (0 for a row with no active entry), the normaliser of Eq. 11/12.

    Rows are shifted by their largest active logit, which leaves the normalised weights (Eq. 11/12)
    unchanged and cannot overflow. When every logit is known to lie in [bound - 60, bound] the shift is
    simply ``bound`` (no masked max needed); ``logits`` is overwritten.
    """
    if logits.shape[1] == 0:
        return logits, logits.new_zeros(logits.shape[0], 1)
    if bound is None:
        top = torch.where(active, logits, float("-inf")).amax(dim=1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, 0.0)
        logits = logits.sub_(top)
    elif bound != 0.0:
        logits = logits.sub_(bound)
    # Active entries are <= 0 after the shift; clamping the others at 0 keeps exp finite so the mask zeroes
    # them (inf * 0 would be NaN).
    w = logits.clamp_(min=_MIN_EXPONENT, max=0.0).exp_().mul_(active)
    total = w.sum(dim=1, keepdim=True)
    return w, torch.where(total > 0, 1.0 / torch.where(total > 0, total, 1.0), 0.0)


class _RankedListKernel:
    metric = "sqeuclidean"
    needs_positive_sets = True

    def __init__(self, margin: float, alpha: float, tn: float, tp: float, lam: float) -> None:
        self.margin, self.alpha, self.tn, self.tp, self.lam = margin, alpha, tn, tp, lam

    def __call__(self, block: QueryBlock) -> BlockResult:
        alpha, boundary, lam = self.alpha, self.alpha - self.margin, self.lam
        assert block.positives is not None
        dist = block.values.sqrt()
        # Negatives (dense): N* = {different label, d < alpha}, weights exp(Tn (alpha - d)) (Eq. 9).
        neg_star = (~block.same_label()).logical_and_(dist < alpha)
        violation = torch.rsub(dist, alpha)
        # Tn (alpha - d) lies in [min(Tn alpha, 0), max(Tn alpha, 0)] on N*, so its upper end is a safe shift
        # whenever that interval is narrow enough for exp; otherwise take the exact masked row maximum.
        bound = max(self.tn * alpha, 0.0) if abs(self.tn * alpha) <= 60.0 else None
        w_neg, inv_z_neg = _set_weights(neg_star, violation * self.tn, bound)
        loss_neg = (w_neg * violation).sum(1, keepdim=True).mul_(inv_z_neg).squeeze(1)  # Eq. 12
        # Positives (sparse): P* = {same label, not the query, d > alpha - margin}, weights of Eq. 10.
        rows = torch.arange(dist.shape[0], device=dist.device)
        pos_cols, pos_real = block.positives.padded(rows + block.rows.start)
        pos_dist = torch.gather(dist, 1, pos_cols)
        pos_star = pos_real & (pos_dist > boundary)
        stretch = pos_dist - boundary
        w_pos, inv_z_pos = _set_weights(pos_star, stretch * self.tp, None)
        loss_pos = (w_pos * stretch).sum(1) * inv_z_pos.squeeze(1)  # Eq. 11
        terms = (1.0 - lam) * loss_pos + lam * loss_neg  # Eq. 13
        valid = pos_star.any(1) | neg_star.any(1)
        jac = block.jacobian
        if jac is not None:
            # Weights are constants: dL/dd_j = (1 - lam) w~_j on P*, -lam w~_j on N*; dd/d(d^2) = 1 / (2d).
            torch.div(w_neg.mul_(inv_z_neg * (-0.5 * lam)), dist.clamp(min=_MIN_DISTANCE), out=jac)
            coincident = neg_star.logical_and_(dist <= _MIN_DISTANCE)  # neg_star is not needed any more
            if bool(coincident.any().item()):
                jac.masked_fill_(coincident, 0.0)
            pos_grad = w_pos * inv_z_pos * (0.5 * (1.0 - lam)) / pos_dist.clamp(min=_MIN_DISTANCE)
            add_at_columns(jac, pos_cols, pos_grad, where=pos_star & (pos_dist > _MIN_DISTANCE))
        count = torch.tensor(float(terms.shape[0]), dtype=torch.float64, device=terms.device)
        return BlockResult(terms=terms, count=count, valid=valid)


@dataclass
class _RankedListState:
    top: Tensor  # (k, 1) largest active negative logit (only needed without a known bound)
    z_neg: Tensor  # (k, 1) sum of the negative weights (Eq. 12's normaliser)
    weighted: Tensor  # (k, 1) sum of weight x violation over N*
    any_neg: Tensor  # (k,) bool: N* is not empty
    inv_z_neg: Tensor | None = None
    pos_grad: Tensor | None = None  # (k, P) the positives' entries


class _RankedListStream:
    """RLL over column tiles: tiles add to the negatives' weight sums (Eq. 12); positives are direct."""

    metric = "sqeuclidean"

    def __init__(self, margin: float, alpha: float, tn: float, tp: float, lam: float) -> None:
        self.margin, self.alpha, self.tn, self.tp, self.lam = margin, alpha, tn, tp, lam
        # As _RankedListKernel: a known upper end of Tn (alpha - d) on N* is a safe shift; without one the
        # exact masked row maximum is found in a first walk over the tiles.
        self.bound = max(tn * alpha, 0.0) if abs(tn * alpha) <= 60.0 else None

    def passes(self) -> int:
        return 1 if self.bound is not None else 2

    def start(self, group: RowGroup) -> _RankedListState:
        k = group.queries.shape[0]
        zeros = group.queries.new_zeros
        top = torch.full((k, 1), float("-inf"), dtype=group.queries.dtype, device=group.queries.device)
        any_neg = torch.zeros(k, dtype=torch.bool, device=top.device)
        return _RankedListState(top=top, z_neg=zeros(k, 1), weighted=zeros(k, 1), any_neg=any_neg)

    def _negatives(self, group: RowGroup, tile: ColumnTile) -> tuple[Tensor, Tensor, Tensor]:
        dist = tile.values.sqrt()
        neg_star = (~tile.same_label(group)).logical_and_(dist < self.alpha)
        return dist, neg_star, torch.rsub(dist, self.alpha)

    def _weights(self, state: _RankedListState, neg_star: Tensor, violation: Tensor) -> Tensor:
        shift = (
            self.bound if self.bound is not None else torch.where(torch.isfinite(state.top), state.top, 0.0)
        )
        logits = violation * self.tn - shift
        return logits.clamp_(min=_MIN_EXPONENT, max=0.0).exp_().mul_(neg_star)

    def add_tile(self, state: _RankedListState, group: RowGroup, tile: ColumnTile, walk: int) -> None:
        _, neg_star, violation = self._negatives(group, tile)
        if walk == 0 and self.bound is None:
            tile_top = torch.where(neg_star, violation * self.tn, float("-inf")).amax(dim=1, keepdim=True)
            torch.maximum(state.top, tile_top, out=state.top)
            return
        w = self._weights(state, neg_star, violation)
        state.z_neg += w.sum(1, keepdim=True)
        state.weighted += (w * violation).sum(1, keepdim=True)
        state.any_neg |= neg_star.any(1)

    def finish(self, state: _RankedListState, group: RowGroup) -> BlockResult:
        lam, boundary = self.lam, self.alpha - self.margin
        z = state.z_neg
        state.inv_z_neg = torch.where(z > 0, 1.0 / torch.where(z > 0, z, 1.0), 0.0)
        loss_neg = (state.weighted * state.inv_z_neg).squeeze(1)  # Eq. 12
        pos_dist = group.pos_values.sqrt()
        pos_star = group.pos_real & (pos_dist > boundary)
        stretch = pos_dist - boundary
        w_pos, inv_z_pos = _set_weights(pos_star, stretch * self.tp, None)
        loss_pos = (w_pos * stretch).sum(1) * inv_z_pos.squeeze(1)  # Eq. 11
        terms = (1.0 - lam) * loss_pos + lam * loss_neg  # Eq. 13
        pos_grad = w_pos * inv_z_pos * (0.5 * (1.0 - lam)) / pos_dist.clamp(min=_MIN_DISTANCE)
        state.pos_grad = torch.where(pos_star & (pos_dist > _MIN_DISTANCE), pos_grad, 0.0)
        valid = pos_star.any(1) | state.any_neg
        count = torch.tensor(float(terms.shape[0]), dtype=torch.float64, device=terms.device)
        return BlockResult(terms=terms, count=count, valid=valid)

    def jacobian(self, state: _RankedListState, group: RowGroup, tile: ColumnTile) -> Tensor:
        assert state.inv_z_neg is not None and state.pos_grad is not None
        dist, neg_star, violation = self._negatives(group, tile)
        w = self._weights(state, neg_star, violation)
        jac = w.mul_(state.inv_z_neg * (-0.5 * self.lam)).div_(dist.clamp(min=_MIN_DISTANCE))
        jac.masked_fill_(neg_star.logical_and_(dist <= _MIN_DISTANCE), 0.0)
        tile.add_at_positives(group, jac, state.pos_grad)
        return jac


class RankedListLoss(RankingLoss):
    """Ranked List Loss ``mean over all queries of (1 - lam) L_P + lam L_N`` (Eq. 13-14).

    Why: RLL pushes each query's negatives beyond ``alpha`` and pulls its positives within
    ``alpha - margin`` with set-wise weighted hinges. ``alpha=None`` is RLL-Simpler:
    ``alpha = 1 + margin / 2``.
    ``tn`` may be changed between steps (see `TnSchedule`, Eq. 15).

    ``gradient="both"`` gives both embeddings of every pair gradient; ``gradient="query"`` treats the other
    examples' features as constants in each query's ranked list (Sec. 3.2), see the module docstring.

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
        gradient: RLLGradient = "both",
        *,
        memory_budget_mb: float | None = None,
        saved_budget_mb: float | None = None,
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb, saved_budget_mb=saved_budget_mb)
        for name, value in (("margin", margin), ("tn", tn), ("tp", tp), ("lam", lam)):
            _require_finite(name, value)
        if alpha is not None:
            _require_finite("alpha", alpha)
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"lam must lie in [0, 1], got {lam!r}")
        if gradient not in RLL_GRADIENTS:
            raise ValueError(f"gradient must be one of {RLL_GRADIENTS}, got {gradient!r}")
        self.gradient: RLLGradient = gradient
        self.margin = float(margin)
        self.alpha = None if alpha is None else float(alpha)
        self.tn = float(tn)
        self.tp = float(tp)
        self.lam = float(lam)

    @property
    def effective_alpha(self) -> float:
        """``alpha``, or RLL-Simpler's ``1 + margin / 2`` when it was left as None."""
        return 1.0 + self.margin / 2.0 if self.alpha is None else self.alpha

    @property
    def gallery_is_constant(self) -> bool:
        """True when only the queries receive gradient (``gradient="query"``): the engine's cue that the
        gathered gallery's gradient needs no cross-rank sum."""
        return self.gradient == "query"

    def _kernel(self) -> _RankedListKernel:
        _require_finite("tn", self.tn)
        return _RankedListKernel(self.margin, self.effective_alpha, self.tn, self.tp, self.lam)

    def _stream_kernel(self) -> _RankedListStream:
        _require_finite("tn", self.tn)
        return _RankedListStream(self.margin, self.effective_alpha, self.tn, self.tp, self.lam)

    def _evaluate(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None,
        ref_labels: Tensor | None,
        query_index: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self.gradient == "query":
            # Sec. 3.2: each ranked list is scored against constant features; the query keeps its gradient
            # through the query side of every distance. In-batch retrieval becomes an explicit gallery of
            # the detached batch (anything malformed still reaches the base class's checks).
            if ref_embeddings is not None:
                ref_embeddings = ref_embeddings.detach()
            elif ref_labels is None and query_index is None and isinstance(embeddings, Tensor):
                ref_embeddings, ref_labels = embeddings.detach(), labels
                query_index = torch.arange(embeddings.shape[0], device=embeddings.device)
        return super()._evaluate(embeddings, labels, ref_embeddings, ref_labels, query_index)

    def extra_repr(self) -> str:
        return (
            f"margin={self.margin}, alpha={self.alpha} (effective {self.effective_alpha}), "
            f"tn={self.tn}, tp={self.tp}, lam={self.lam}, gradient={self.gradient!r}"
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
        """Everything needed to resume the schedule from a checkpoint."""
        return {"t1": self.t1, "t2": self.t2, "max_iter": self.max_iter, "cur_iter": self.cur_iter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpointed schedule and re-apply its Tn to the loss."""
        self.t1, self.t2 = float(state["t1"]), float(state["t2"])
        self.max_iter, self.cur_iter = int(state["max_iter"]), int(state["cur_iter"])
        self.loss.tn = self.value()


def _require_finite(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
