"""Smooth-AP (Brown et al., ECCV 2020), Eq. 5-7 with the sigmoid of Eq. 6, in O(B K B) work.

As in the paper (and unlike the released code) the query is neither in its own retrieval set nor in its
positive set. AP_q only needs, for each positive i of q, the sigmoid of (s_qj - s_qi) for every item j: a
``(queries x |P_q| x N)`` slab, evaluated in chunks sized from the memory budget, for any label layout. The
gradient is derived in closed form in the same pass, so nothing of size ``B x K x B`` is kept for backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from dmltrain.losses._rowwise import BlockResult, QueryBlock, add_at_columns
from dmltrain.losses._streamed import ColumnTile, RowGroup
from dmltrain.losses.base import RankingLoss


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


@dataclass
class _SmoothAPState:
    rank_all: Tensor  # (k, P) 1 + sum over the retrieval set of G[q, i, j]
    slope_sum: Tensor  # (k, P) sum over the retrieval set of G (1 - G)
    coef_ratio: Tensor | None = None  # (k, P) c_i * ratio_i (0 on padding)
    pos_grad: Tensor | None = None  # (k, P) the positives' extra entries


class _SmoothAPStream:
    """Smooth-AP over column tiles: each tile adds to every (query, positive) rank sum; the positive-set
    rank sums and the positives' extra Jacobian entries come from the positives' own similarities."""

    metric = "dot"

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def passes(self) -> int:
        return 1

    def start(self, group: RowGroup) -> _SmoothAPState:
        shape = group.pos_cols.shape
        zeros = group.queries.new_zeros
        return _SmoothAPState(rank_all=zeros(shape) + 1.0, slope_sum=zeros(shape))

    def _slabs(self, group: RowGroup, tile: ColumnTile) -> Iterator[tuple[slice, slice, Tensor]]:
        """(rows, positives, G) with G[q, i, j] = sigmoid((s_qj - s_qi) / tau), 0 for j = i and j = q."""
        tau = self.temperature
        scaled = tile.values / tau
        s_pos = group.pos_values / tau
        k, width = group.pos_cols.shape
        row_step, pos_step = group.slab_steps(tile.values.shape[1])
        self_rows, self_cols = tile.self_hits(group)
        hit_rows, hit_slots, hit_cols = tile.positive_hits(group)
        for r0 in range(0, k, row_step):
            r1 = min(k, r0 + row_step)
            for p0 in range(0, width, pos_step):
                p1 = min(width, p0 + pos_step)
                g = torch.sigmoid_(scaled[r0:r1, None, :] - s_pos[r0:r1, p0:p1, None])
                sel = (hit_rows >= r0) & (hit_rows < r1) & (hit_slots >= p0) & (hit_slots < p1)
                g[hit_rows[sel] - r0, hit_slots[sel] - p0, hit_cols[sel]] = 0.0  # j != i
                sel = (self_rows >= r0) & (self_rows < r1)
                g[self_rows[sel] - r0, :, self_cols[sel]] = 0.0  # the query itself is not retrieved
                yield slice(r0, r1), slice(p0, p1), g

    def add_tile(self, state: _SmoothAPState, group: RowGroup, tile: ColumnTile, walk: int) -> None:
        for rows, pos, g in self._slabs(group, tile):
            state.rank_all[rows, pos] += g.sum(2)
            state.slope_sum[rows, pos] += g.addcmul_(g, g, value=-1.0).sum(2)

    def finish(self, state: _SmoothAPState, group: RowGroup) -> BlockResult:
        tau = self.temperature
        k, width = group.pos_cols.shape
        valid, real = group.n_pos > 0, group.pos_real
        n_pos = group.n_pos.clamp(min=1).to(state.rank_all.dtype)
        s_pos = group.pos_values / tau
        ratio = torch.zeros_like(state.rank_all)
        pos_grad = torch.zeros_like(state.rank_all)
        coef = torch.where(real, -1.0 / (n_pos[:, None] * tau * state.rank_all), 0.0)
        eye = torch.eye(width, dtype=torch.bool, device=s_pos.device)
        step = max(1, group.chunk_elements // max(width * width, 1))
        for r0 in range(0, k, step):  # G among the positives: (rows x P x P) in chunks
            r = slice(r0, min(k, r0 + step))
            mask = real[r, None, :] & real[r, :, None] & ~eye
            g_pos = torch.sigmoid(s_pos[r, None, :] - s_pos[r, :, None]).mul_(mask)  # [q, i, j]
            ratio[r] = (1.0 + g_pos.sum(2)) / state.rank_all[r]
            slope_pos = g_pos.addcmul_(g_pos, g_pos, value=-1.0)
            # d term / dG_ij = c_i ([j in P] - ratio_i), c_i = -1 / (n tau rank_all_i) (see _SmoothAPKernel)
            through_i = coef[r] * (slope_pos.sum(2) - ratio[r] * state.slope_sum[r])
            pos_grad[r] = torch.einsum("ki,kij->kj", coef[r], slope_pos) - through_i
        ap_sum = (ratio * real).sum(1)
        state.coef_ratio = coef * ratio
        state.pos_grad = pos_grad
        terms = torch.where(valid, 1.0 - ap_sum / n_pos, 0.0)
        return BlockResult(terms=terms, count=valid.sum(), valid=valid)

    def jacobian(self, state: _SmoothAPState, group: RowGroup, tile: ColumnTile) -> Tensor:
        assert state.coef_ratio is not None and state.pos_grad is not None
        jac = torch.zeros_like(tile.values)
        for rows, pos, g in self._slabs(group, tile):
            slope = g.addcmul_(g, g, value=-1.0)
            jac[rows] -= torch.bmm(state.coef_ratio[rows, None, pos], slope).squeeze(1)
        tile.add_at_positives(group, jac, state.pos_grad)
        return jac


class SmoothAPLoss(RankingLoss):
    """Smooth-AP loss ``mean_q (1 - AP_q)`` over queries with at least one positive (cosine similarity).

    Why: Smooth-AP replaces the ranking indicator of AP by a sigmoid of temperature ``tau`` (0.01 in the
    paper), so AP itself is optimised; small ``tau`` approaches the exact AP.

    ``reduction="none"`` gives ``1 - AP_q`` per query and 0 for queries without positives; ``parts().count``
    and ``num_valid`` are the number of queries with a positive. Similarities are plain dot products of the
    (L2-normalised) embeddings.
    """

    def __init__(
        self,
        temperature: float = 0.01,
        *,
        memory_budget_mb: float | None = None,
        saved_budget_mb: float | None = None,
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb, saved_budget_mb=saved_budget_mb)
        if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
            raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
        self.temperature = float(temperature)

    def _kernel(self) -> _SmoothAPKernel:
        return _SmoothAPKernel(self.temperature)

    def _stream_kernel(self) -> _SmoothAPStream:
        return _SmoothAPStream(self.temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"
