"""Smooth-AP (Brown et al., ECCV 2020), Eq. 5-7 with the sigmoid of Eq. 6, in O(B K B) work.

As in the paper (and unlike the released code) the query is neither in its own retrieval set nor in its
positive set. AP_q only needs, for each positive i of q, the sigmoid of (s_qj - s_qi) for every item j: a
``(queries x |P_q| x N)`` slab, evaluated in chunks sized from the memory budget, for any label layout. The
gradient is derived in closed form in the same pass, so nothing of size ``B x K x B`` is kept for backward.
"""

from __future__ import annotations

import math

import torch

from dmltrain.losses._rowwise import BlockResult, QueryBlock, add_at_columns
from dmltrain.losses.base import DEFAULT_MEMORY_BUDGET_MB, RankingLoss


class _SmoothAPKernel:
    metric = "dot"
    needs_positive_sets = True

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, block: QueryBlock) -> BlockResult:
        tau = self.temperature
        scaled = block.values / tau
        assert block.positives is not None
        n_pos = block.positives.counts[block.rows]
        valid = n_pos > 0
        ap_sum = torch.zeros_like(scaled[:, 0])
        has_self = block.self_col >= 0  # all or none: set by whether query_index was given
        jac = block.jacobian
        if jac is not None:
            jac.zero_()
        for n, rows, cols, all_cols in block.positive_chunks():
            c = cols.shape[1]
            s_rows = scaled[rows]  # (k, N)
            s_pos = torch.gather(s_rows, 1, cols)  # (k, c): s_qi / tau for the chunk's positives i
            # G[q, i, j] = sigmoid((s_qj - s_qi) / tau): does j rank above positive i?
            g = torch.sigmoid_(s_rows[:, None, :] - s_pos[:, :, None])  # (k, c, N)
            g.scatter_(2, cols[:, :, None], 0.0)  # j != i
            if bool(has_self[rows].any().item()):
                self_cols = block.self_col[rows][:, None, None].expand(-1, c, 1)
                g.scatter_(2, self_cols, 0.0)  # the query itself is not retrieved
            rank_all = 1.0 + g.sum(2)  # (k, c): 1 + sum over the retrieval set
            g_pos = torch.gather(g, 2, all_cols[:, None, :].expand(-1, c, -1))  # (k, c, n)
            rank_pos = 1.0 + g_pos.sum(2)  # 1 + sum over the positive set
            ratio = rank_pos / rank_all
            ap_sum[rows] += ratio.sum(1)
            if jac is None:
                continue
            # term = 1 - (1/n) sum_i rank_pos_i / rank_all_i, so d term / dG_ij = c_i ([j in P] - ratio_i)
            # with c_i = -1 / (n rank_all_i); and dG_ij / ds_qj = -dG_ij / ds_qi = G (1 - G) / tau.
            coef = -1.0 / (n * tau * rank_all)  # (k, c)
            slope = g.addcmul_(g, g, value=-1.0)  # G (1 - G) in g's storage; masked entries stay 0
            slope_pos = g_pos.addcmul_(g_pos, g_pos, value=-1.0)
            rows_jac = jac[rows]  # a view when rows is a slice, else a copy written back below
            rows_jac -= torch.bmm((coef * ratio)[:, None, :], slope).squeeze(1)
            add_at_columns(rows_jac, all_cols, torch.einsum("kc,kcn->kn", coef, slope_pos))
            through_i = coef * (slope_pos.sum(2) - ratio * slope.sum(2))
            add_at_columns(rows_jac, cols, -through_i)
            if not isinstance(rows, slice):
                jac[rows] = rows_jac
        denom = n_pos.clamp(min=1).to(scaled.dtype)
        terms = torch.where(valid, 1.0 - ap_sum / denom, 0.0)
        return BlockResult(terms=terms, count=valid.sum(), valid=valid)


class SmoothAPLoss(RankingLoss):
    """Smooth-AP loss ``mean_q (1 - AP_q)`` over queries with at least one positive (cosine similarity).

    Why: Smooth-AP replaces the ranking indicator of AP by a sigmoid of temperature ``tau`` (0.01 in the
    paper), so AP itself is optimised; small ``tau`` approaches the exact AP.

    ``reduction="none"`` gives ``1 - AP_q`` per query and 0 for queries without positives; ``parts().count``
    and ``num_valid`` are the number of queries with a positive. Similarities are plain dot products of the
    (L2-normalised) embeddings.
    """

    def __init__(
        self, temperature: float = 0.01, *, memory_budget_mb: float = DEFAULT_MEMORY_BUDGET_MB
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb)
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
        self.temperature = float(temperature)

    def _kernel(self) -> _SmoothAPKernel:
        return _SmoothAPKernel(self.temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"
