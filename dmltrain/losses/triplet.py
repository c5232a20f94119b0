"""Triplet hinge of Deep Ranking (Wang et al., CVPR 2014): Eq. 1-2 on the sampled or on all triplets.

``max(0, g + ||a - p||^2 - ||a - n||^2)`` on squared Euclidean distances (Eq. 1; Eq. 2 for unit vectors).

- ``triplets="sampled"`` is the paper's objective (supplement Eq. 7-8): a sum over the triplets the online
  sampler chose (Alg. 1), which arrive as consecutive rows ``[q0, p0, n0, q1, p1, n1, ...]`` (the layout of
  `dmltrain.data.sampling.TripletBatcher`), divided by the number of sampled triplets (a constant, so the
  gradient is Eq. 8's up to the learning-rate scale). Only these triplets are scored, so the sampler's
  choices (in-category negatives) are what the network learns from.
- ``triplets="all"`` scores every valid (anchor, positive, negative) triplet the labels imply, averaged over
  the *active* ones (positive hinge). Triplets are never materialised as index lists: for each anchor and
  positive the hinge against all items is one row of a ``(anchors x |P| x N)`` slab processed in
  budget-sized chunks.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from dmltrain.losses._rowwise import BlockResult, QueryBlock, add_at_columns
from dmltrain.losses._streamed import ColumnTile, RowGroup
from dmltrain.losses.base import RankingLoss, _validated

TripletSet = Literal["sampled", "all"]
TRIPLET_SETS: tuple[TripletSet, ...] = ("sampled", "all")


class _TripletKernel:
    metric = "sqeuclidean"
    needs_positive_sets = True

    def __init__(self, margin: float) -> None:
        self.margin = margin

    def __call__(self, block: QueryBlock) -> BlockResult:
        d2 = block.values
        # Non-negatives (positives, the anchor itself) get +inf so their hinge is exactly 0.
        d2_neg = torch.where(block.same_label(), float("inf"), d2)
        terms = torch.zeros_like(d2[:, 0])
        active_per_anchor = torch.zeros(d2.shape[0], dtype=torch.float64, device=d2.device)
        jac = block.jacobian
        if jac is not None:
            jac.zero_()
        for _, rows, cols, _ in block.positive_chunks():
            d2_ap = torch.gather(d2[rows], 1, cols)  # (k, c)
            hinge = (d2_ap + self.margin)[:, :, None] - d2_neg[rows][:, None, :]  # (k, c, N)
            hinge.clamp_(min=0)
            active = hinge.clamp(max=1.0).ceil_()  # 1.0 for an active triplet, else 0.0 (float, fast)
            terms[rows] += hinge.sum((1, 2))
            # per-anchor counts are exact in float64 (and in a float32 chunk sum below 2^24 elements)
            active_per_anchor[rows] += active.sum((1, 2)).to(torch.float64)
            if jac is not None:
                # d hinge / d d2(a, n) = -1 and d hinge / d d2(a, p) = +1 for every active triplet.
                rows_jac = jac[rows]  # a view when rows is a slice, else a copy written back below
                rows_jac -= active.sum(1)
                add_at_columns(rows_jac, cols, active.sum(2))
                if not isinstance(rows, slice):
                    jac[rows] = rows_jac
        valid = active_per_anchor > 0
        return BlockResult(terms=terms, count=active_per_anchor.sum(), valid=valid)


@dataclass
class _TripletState:
    terms: Tensor  # (k,) sum of hinges per anchor
    active: Tensor  # (k,) float64 active triplets per anchor
    active_per_positive: Tensor  # (k, P) active triplets per (anchor, positive): d/d d2(a, p)


class _TripletStream:
    """Triplet hinge over column tiles: each tile holds candidate negatives for every (anchor, positive)."""

    metric = "sqeuclidean"

    def __init__(self, margin: float) -> None:
        self.margin = margin

    def passes(self) -> int:
        return 1

    def start(self, group: RowGroup) -> _TripletState:
        k = group.queries.shape[0]
        zeros = group.queries.new_zeros
        active = torch.zeros(k, dtype=torch.float64, device=group.queries.device)
        return _TripletState(terms=zeros(k), active=active, active_per_positive=zeros(group.pos_cols.shape))

    def _slabs(self, group: RowGroup, tile: ColumnTile) -> Iterator[tuple[slice, slice, Tensor, Tensor]]:
        """(rows, positives, hinge, active) over (rows x positives x tile); padding slots are inactive."""
        d2_neg = torch.where(tile.same_label(group), float("inf"), tile.values)  # non-negatives: hinge 0
        d2_ap = torch.where(group.pos_real, group.pos_values, float("-inf"))
        k, width = group.pos_cols.shape
        row_step, pos_step = group.slab_steps(tile.values.shape[1])
        for r0 in range(0, k, row_step):
            r1 = min(k, r0 + row_step)
            for p0 in range(0, width, pos_step):
                p1 = min(width, p0 + pos_step)
                hinge = (d2_ap[r0:r1, p0:p1] + self.margin)[:, :, None] - d2_neg[r0:r1, None, :]
                hinge.clamp_(min=0)
                yield slice(r0, r1), slice(p0, p1), hinge, hinge.clamp(max=1.0).ceil_()

    def add_tile(self, state: _TripletState, group: RowGroup, tile: ColumnTile, walk: int) -> None:
        for rows, pos, hinge, active in self._slabs(group, tile):
            state.terms[rows] += hinge.sum((1, 2))
            state.active[rows] += active.sum((1, 2)).to(torch.float64)
            state.active_per_positive[rows, pos] += active.sum(2)

    def finish(self, state: _TripletState, group: RowGroup) -> BlockResult:
        valid = state.active > 0
        return BlockResult(terms=state.terms, count=state.active.sum(), valid=valid)

    def jacobian(self, state: _TripletState, group: RowGroup, tile: ColumnTile) -> Tensor:
        jac = torch.zeros_like(tile.values)
        for rows, _, _, active in self._slabs(group, tile):
            jac[rows] -= active.sum(1)  # d hinge / d d2(a, n) = -1 per active triplet
        tile.add_at_positives(group, jac, state.active_per_positive)  # and +1 for d2(a, p)
        return jac


def _sampled_terms(
    margin: float,
    embeddings: Tensor,
    labels: Tensor,
    ref_embeddings: Tensor | None,
    ref_labels: Tensor | None,
    query_index: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-query terms of the sampled triplets: an anchor's hinge, 0 for positives and negatives.

    The reference set (the batch, or the gathered global batch) must be whole triplets in the sampler's
    layout; a query's triplet is found from its row in the reference set, so a rank's queries may be any
    rows of the global batch. Gradients reach all three members through autograd (no B x B work at all).
    """
    queries, _, refs, r_labels, self_col = _validated(
        embeddings, labels, ref_embeddings, ref_labels, query_index
    )
    n_ref = refs.shape[0]
    if n_ref % 3:
        raise ValueError(
            f"triplets='sampled' needs whole triplets [q0, p0, n0, q1, ...] (the triplet sampler's layout); "
            f"the reference batch has {n_ref} rows, not a multiple of 3"
        )
    if self_col.numel() and bool((self_col < 0).any().item()):
        raise ValueError("triplets='sampled' needs query_index: a query's triplet is found from its row")
    anchors_r, positives_r, negatives_r = r_labels[0::3], r_labels[1::3], r_labels[2::3]
    broken = (anchors_r != positives_r) | (anchors_r == negatives_r)
    if bool(broken.any().item()):
        first = int(torch.nonzero(broken)[0].item())
        raise ValueError(
            f"triplets='sampled': rows {3 * first}..{3 * first + 2} are not a (query, positive, negative) "
            f"triplet (labels {r_labels[3 * first : 3 * first + 3].tolist()}); batches must come from the "
            "triplet sampler (sampler.name=triplet), or use triplets='all'"
        )
    is_anchor = self_col % 3 == 0
    rows = torch.nonzero(is_anchor).squeeze(1)
    anchor_col = self_col[rows]
    a = queries[rows]
    d_ap = (a - refs[anchor_col + 1]).pow(2).sum(1)
    d_an = (a - refs[anchor_col + 2]).pow(2).sum(1)
    hinge = torch.relu(margin + d_ap - d_an)
    terms = torch.zeros(queries.shape[0], dtype=queries.dtype, device=queries.device).index_put(
        (rows,), hinge
    )
    count = torch.tensor(float(rows.numel()), dtype=queries.dtype, device=queries.device)
    return terms, count, (hinge.detach() > 0).sum()


class TripletLoss(RankingLoss):
    """Deep Ranking triplet hinge, on the sampled triplets or on every triplet the labels imply.

    Why: the Deep Ranking baseline the listwise losses are compared against.

    ``triplets="all"`` (the default, DESIGN.md's in-batch form; any label layout): the mean over active
    triplets, which keeps the gradient scale independent of how many triplets are already satisfied;
    ``reduction="none"`` gives each anchor's *sum* of hinges, ``parts().count`` is the number of active
    triplets and ``num_valid`` the anchors with one or more.

    ``triplets="sampled"`` (Deep Ranking Eq. 8; batches from the triplet sampler): the mean over the
    sampled triplets, rows ``(3i, 3i + 1, 3i + 2)`` of the reference set; ``reduction="none"`` gives each
    anchor's hinge (0 for positive and negative rows), ``parts().count`` is the number of triplets whose
    anchor is among the queries and ``num_valid`` the active ones.
    """

    def __init__(
        self,
        margin: float = 0.2,
        triplets: TripletSet = "all",
        *,
        memory_budget_mb: float | None = None,
        saved_budget_mb: float | None = None,
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb, saved_budget_mb=saved_budget_mb)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise ValueError(f"margin must be a finite number, got {margin!r}")
        if triplets not in TRIPLET_SETS:
            raise ValueError(f"triplets must be one of {TRIPLET_SETS}, got {triplets!r}")
        self.margin = float(margin)
        self.triplets: TripletSet = triplets

    def _kernel(self) -> _TripletKernel:
        return _TripletKernel(self.margin)

    def _stream_kernel(self) -> _TripletStream:
        return _TripletStream(self.margin)

    def _evaluate(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None,
        ref_labels: Tensor | None,
        query_index: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if self.triplets == "sampled":
            return _sampled_terms(self.margin, embeddings, labels, ref_embeddings, ref_labels, query_index)
        return super()._evaluate(embeddings, labels, ref_embeddings, ref_labels, query_index)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, triplets={self.triplets!r}"
