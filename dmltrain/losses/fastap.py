"""FastAP (Cakir et al., CVPR 2019): AP from soft distance histograms, with the closed-form gradient.

Follows the paper (Eq. 14) and supplement C.1-C.3 with the released code's binning: for ``num_bins=L``
there are L+1 bin centres ``linspace(0, 4, L+1)`` on the squared distance ``d = 2 - 2 x.y`` of L2-normalised
embeddings, triangular soft binning of width ``4/L``, ``|P_q|`` the hard count of positives and
0/0 histogram terms counted as 0. The gradient is the true gradient of the mean loss (the released code's
hand-written backward is B/2 times too large). Histograms are built per query row, block by block, from
cumulative bin masses (one clamp-and-sum pass per bin), so there is no ``B x B x (L+1)`` tensor and no
scatter-add (deterministic on any device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dmltrain.losses._rowwise import BlockResult, QueryBlock, add_at_columns
from dmltrain.losses._streamed import ColumnTile, RowGroup
from dmltrain.losses.base import RankingLoss

_CENTRE_ULPS = 64  # rounding of a similarity, in units of the dtype's eps, times the bins (on_first_centre)


class _FastAPKernel:
    metric = "dot"
    needs_positive_sets = True

    def __init__(self, num_bins: int) -> None:
        self.num_bins = num_bins

    def __call__(self, block: QueryBlock) -> BlockResult:
        L = self.num_bins
        sim = block.values
        n_rows = sim.shape[0]
        assert block.positives is not None
        n_pos = block.positives.counts[block.rows]
        valid = n_pos > 0
        # Distance in units of the bin width: t = (2 - 2s) / (4 / L); bin centres sit at t = 0, 1, ..., L.
        # The query's own row is moved to t = L + 2, outside every bin.
        t = sim.mul(-L / 2).add_(L / 2)
        t_max = float(t.amax().item()) if t.numel() else 0.0
        has_self = block.self_col >= 0
        rows_with_self = torch.nonzero(has_self).squeeze(1)
        t[rows_with_self, block.self_col[rows_with_self]] = L + 2.0
        t_min = on_first_centre(t, L)
        # The mass an item puts into bins <= l (sum of the triangles relu(1 - |t - k|), k <= l) is
        # clamp(l + 1 - t, 0, 1) - clamp(-t, 0, 1); the second part only exists for t < 0 (outside [0, 4]).
        # Sums of non-negative terms only, so no cancellation in float32 however large the gallery. Bins
        # below every item hold nothing and bins above every item hold everything: no pass needed there.
        below_zero = t.neg().clamp_(0, 1).sum(1, keepdim=True) if t_min < 0 else None
        cum_all = torch.empty(n_rows, L + 1, dtype=sim.dtype, device=sim.device)
        n_items = (sim.shape[1] - has_self.long()).to(sim.dtype)
        for level in range(L + 1):
            if level + 1 <= t_min:
                cum_all[:, level] = 0.0
            elif level >= t_max:
                cum_all[:, level] = n_items
            else:
                cum_all[:, level] = torch.rsub(t, level + 1).clamp_(0, 1).sum(1)
        if below_zero is not None:
            cum_all -= below_zero
        # Positives are few: their cumulative histogram comes from a padded gather of their t.
        pos_cols, pos_real = block.positives.padded(torch.arange(n_rows, device=t.device) + block.rows.start)
        t_pos = torch.where(pos_real, torch.gather(t, 1, pos_cols), L + 2.0)  # padding: outside every bin
        cum_pos = torch.stack([torch.rsub(t_pos, level + 1).clamp_(0, 1).sum(1) for level in range(L + 1)], 1)
        cum_pos -= t_pos.neg().clamp_(0, 1).sum(1, keepdim=True)
        h_pos = torch.diff(cum_pos, dim=1, prepend=torch.zeros_like(cum_pos[:, :1]))
        safe = cum_all > 0
        inv_all = torch.where(safe, 1.0 / torch.where(safe, cum_all, 1.0), 0.0)
        prec = cum_pos * inv_all  # H+_l / H_l
        frac = h_pos * inv_all  # h+_l / H_l
        inv_npos = torch.where(valid, 1.0 / n_pos.clamp(min=1).to(sim.dtype), 0.0)
        fast_ap = (frac * cum_pos).sum(1) * inv_npos  # Eq. 14
        terms = torch.where(valid, 1.0 - fast_ap, 0.0)
        if block.jacobian is not None:
            self._jacobian(block, t, pos_cols, pos_real, frac, prec, inv_npos, t_min < 0)
        return BlockResult(terms=terms, count=valid.sum(), valid=valid)

    def _jacobian(self, block, t, pos_cols, pos_real, frac, prec, inv_npos, has_tail: bool) -> None:
        """d(1 - FastAP_q)/ds_qj from dFastAP/dH_l and dFastAP/dH+_l (supplement C.3, on cumulative bins)."""
        L = self.num_bins
        jac = block.jacobian
        assert jac is not None
        # With H and H+ as independent variables (h+_l = H+_l - H+_{l-1}):
        d_all = -(frac * prec) * inv_npos[:, None]
        prec_next = torch.cat((prec[:, 1:], torch.zeros_like(prec[:, :1])), dim=1)
        d_pos = (frac + prec - prec_next) * inv_npos[:, None]
        # term = 1 - FastAP and dt/ds = -L/2, so dterm/ds = (L/2) dFastAP/dt. An item with t in (l, l+1)
        # only changes H_l, by -dt: dterm/ds = -(L/2) dFastAP/dH_l. Table column l+1 holds that; columns 0 and
        # L+2 are zeros for items below / above every bin. ceil(t - floor(t)) is 0 exactly at bin centres,
        # where the derivative is taken as 0 like autograd through relu(1 - |t - c|).
        zero = torch.zeros_like(d_all[:, :1])
        table = torch.cat((zero, d_all * (-L / 2), zero), dim=1)
        low = t.floor()
        interior = torch.sub(t, low).ceil_()
        idx = low.clamp_(-1, L + 1).add_(1).long()
        torch.mul(torch.gather(table, 1, idx), interior, out=jac)
        # positives also move H+
        pos_idx = torch.gather(idx, 1, pos_cols) - 1
        pos_interior = torch.gather(interior, 1, pos_cols)
        in_bins = ((pos_idx >= 0) & (pos_idx <= L)).to(t.dtype)
        pos_grad = torch.gather(d_pos, 1, pos_idx.clamp(0, L)) * (pos_interior * in_bins * (-L / 2))
        if has_tail:  # t in (-1, 0), only for non-normalised inputs: adds mass to every cumulative bin
            tail = ((t < 0) & (t > -1)).to(t.dtype)
            jac += tail * (d_all.sum(1, keepdim=True) * (L / 2))
            pos_grad += torch.gather(tail, 1, pos_cols) * (d_pos.sum(1, keepdim=True) * (L / 2))
        add_at_columns(jac, pos_cols, pos_grad, where=pos_real)


def on_first_centre(t: Tensor, num_bins: int) -> float:
    """Put the items within rounding of the first bin centre (t = 0: similarity 1, a duplicate of the query)
    on it, in place; returns the minimum of ``t`` (0 for an empty one) after that.

    The triangle kernel has a kink at every centre, and at t = 0 a third slope (t < 0 only exists through
    rounding for normalised inputs): a duplicate's gradient depended on the last bit of its similarity,
    which differs between two products of the same vectors (row blocks, column tiles, GPU kernels) and was
    several times the whole gradient's size. One pass more only when some item is that close."""
    if t.numel() == 0:
        return 0.0
    t_min = float(t.amin().item())
    snap = _CENTRE_ULPS * torch.finfo(t.dtype).eps * num_bins
    if t_min >= snap:
        return t_min
    t.masked_fill_(t.abs() < snap, 0.0)
    return float(t.amin().item())


@dataclass
class _FastAPState:
    cum_all: Tensor  # (k, L+1) cumulative bin masses of all items, before the t < 0 correction
    below_zero: Tensor  # (k, 1) the t < 0 correction
    pos_values: Tensor  # (k, P) the positives' similarities as their tiles computed them
    table: Tensor | None = None  # (k, L+3) dterm/ds per bin (see _FastAPKernel._jacobian)
    d_all_sum: Tensor | None = None  # (k, 1) for items with t in (-1, 0)
    pos_grad: Tensor | None = None  # (k, P) the positives' extra entries (they also move H+)


class _FastAPStream:
    """FastAP over column tiles: tiles add to the cumulative histogram H, positives give H+ directly."""

    metric = "dot"

    def __init__(self, num_bins: int) -> None:
        self.num_bins = num_bins

    def passes(self) -> int:
        return 1

    def start(self, group: RowGroup) -> _FastAPState:
        k, L = group.queries.shape[0], self.num_bins
        zeros = group.queries.new_zeros
        return _FastAPState(
            cum_all=zeros(k, L + 1), below_zero=zeros(k, 1), pos_values=group.pos_values.clone()
        )

    def _t(self, group: RowGroup, tile: ColumnTile) -> tuple[Tensor, float, float, Tensor]:
        """Distance in bin widths with the query's own column moved outside every bin; max before the move,
        min after it."""
        L = self.num_bins
        t = tile.values.mul(-L / 2).add_(L / 2)
        t_max = float(t.amax().item()) if t.numel() else 0.0
        rows, cols = tile.self_hits(group)
        t[rows, cols] = L + 2.0
        t_min = on_first_centre(t, L)
        return t, t_max, t_min, rows

    def add_tile(self, state: _FastAPState, group: RowGroup, tile: ColumnTile, walk: int) -> None:
        L = self.num_bins
        # H+ takes each positive's value from its tile, as H does: the row group's own product of the
        # positives can differ in the last bit, which put one item on both sides of a kink.
        rows, slots, local = tile.positive_hits(group)
        state.pos_values[rows, slots] = tile.values[rows, local]
        t, t_max, t_min, self_rows = self._t(group, tile)
        items = torch.full((t.shape[0],), float(t.shape[1]), dtype=t.dtype, device=t.device)
        items[self_rows] -= 1.0
        for level in range(L + 1):  # the same shortcuts as the unstreamed kernel, per tile
            if level + 1 <= t_min:
                continue
            if level >= t_max:
                state.cum_all[:, level] += items
            else:
                state.cum_all[:, level] += torch.rsub(t, level + 1).clamp_(0, 1).sum(1)
        if t_min < 0:
            state.below_zero += t.neg().clamp_(0, 1).sum(1, keepdim=True)

    def finish(self, state: _FastAPState, group: RowGroup) -> BlockResult:
        L = self.num_bins
        n_pos, valid = group.n_pos, group.n_pos > 0
        cum_all = state.cum_all - state.below_zero
        t_pos = torch.where(group.pos_real, state.pos_values.mul(-L / 2).add_(L / 2), L + 2.0)
        on_first_centre(t_pos, L)
        cum_pos = torch.stack([torch.rsub(t_pos, level + 1).clamp_(0, 1).sum(1) for level in range(L + 1)], 1)
        cum_pos -= t_pos.neg().clamp_(0, 1).sum(1, keepdim=True)
        h_pos = torch.diff(cum_pos, dim=1, prepend=torch.zeros_like(cum_pos[:, :1]))
        safe = cum_all > 0
        inv_all = torch.where(safe, 1.0 / torch.where(safe, cum_all, 1.0), 0.0)
        prec, frac = cum_pos * inv_all, h_pos * inv_all
        inv_npos = torch.where(valid, 1.0 / n_pos.clamp(min=1).to(cum_all.dtype), 0.0)
        terms = torch.where(valid, 1.0 - (frac * cum_pos).sum(1) * inv_npos, 0.0)
        # The Jacobian's per-row parts, exactly as _FastAPKernel._jacobian builds them.
        d_all = -(frac * prec) * inv_npos[:, None]
        prec_next = torch.cat((prec[:, 1:], torch.zeros_like(prec[:, :1])), dim=1)
        d_pos = (frac + prec - prec_next) * inv_npos[:, None]
        zero = torch.zeros_like(d_all[:, :1])
        state.table = torch.cat((zero, d_all * (-L / 2), zero), dim=1)
        state.d_all_sum = d_all.sum(1, keepdim=True) * (L / 2)
        low = t_pos.floor()
        pos_interior = torch.sub(t_pos, low).ceil_()
        pos_idx = low.clamp_(-1, L + 1).long()
        in_bins = ((pos_idx >= 0) & (pos_idx <= L)).to(t_pos.dtype)
        pos_grad = torch.gather(d_pos, 1, pos_idx.clamp(0, L)) * (pos_interior * in_bins * (-L / 2))
        tail = ((t_pos < 0) & (t_pos > -1)).to(t_pos.dtype)
        pos_grad += tail * (d_pos.sum(1, keepdim=True) * (L / 2))
        state.pos_grad = pos_grad
        return BlockResult(terms=terms, count=valid.sum(), valid=valid)

    def jacobian(self, state: _FastAPState, group: RowGroup, tile: ColumnTile) -> Tensor:
        L = self.num_bins
        assert state.table is not None and state.d_all_sum is not None and state.pos_grad is not None
        t, _, _, _ = self._t(group, tile)
        has_tail = bool((t < 0).any().item())
        low = t.floor()
        interior = torch.sub(t, low).ceil_()
        idx = low.clamp_(-1, L + 1).add_(1).long()
        jac = torch.gather(state.table, 1, idx).mul_(interior)
        if has_tail:
            jac += ((t < 0) & (t > -1)).to(t.dtype) * state.d_all_sum
        tile.add_at_positives(group, jac, state.pos_grad)
        return jac


class FastAPLoss(RankingLoss):
    """FastAP loss ``1 - mean_q FastAP_q`` over queries with at least one positive.

    Why this form: FastAP is the listwise objective the paper trains at batch sizes in the thousands; the
    exact soft-histogram definition is kept so runs are comparable with the paper.

    ``reduction="none"`` gives ``1 - FastAP_q`` per query and 0 for queries without positives;
    ``parts().count`` and ``num_valid`` are the number of queries with a positive. A query with positives
    but no negatives has FastAP 1. Embeddings are expected L2-normalised: the distance is ``2 - 2 x.y`` and
    items outside ``[-4/L, 4 + 4/L]`` fall outside every bin.
    """

    def __init__(
        self,
        num_bins: int = 10,
        *,
        memory_budget_mb: float | None = None,
        saved_budget_mb: float | None = None,
    ) -> None:
        super().__init__(memory_budget_mb=memory_budget_mb, saved_budget_mb=saved_budget_mb)
        if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
            raise ValueError(f"num_bins must be a positive integer, got {num_bins!r}")
        self.num_bins = num_bins

    def _kernel(self) -> _FastAPKernel:
        return _FastAPKernel(self.num_bins)

    def _stream_kernel(self) -> _FastAPStream:
        return _FastAPStream(self.num_bins)

    def extra_repr(self) -> str:
        return f"num_bins={self.num_bins}"
