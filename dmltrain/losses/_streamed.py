"""Column-streamed evaluation: the ``rows x columns`` Jacobian of `_rowwise` is never kept.

`_rowwise` keeps ``J = dt/dS`` (``B_q x N``) between forward and backward: 64 GiB at B=131,072 on one
device. When that would not fit, each block of query rows walks the reference set in column tiles
instead. Forward: every tile's similarities feed per-row statistics (histogram masses, rank sums, weight
normalisers, active counts), from which the terms follow. Backward: the tiles are walked again, each tile's
similarities recomputed, its slice of ``J`` formed from the saved per-row statistics and contracted into
the embedding gradients at once. Memory: one ``rows x tile`` block plus ``O(rows x positives)`` statistics
per row block; work: the similarity matmul twice.

A streaming kernel works on a `RowGroup` (a block of queries with their positives, whose similarities are
computed directly, since the kernels need them before the tiles arrive) and `ColumnTile` s. The positives'
own Jacobian entries are added to the tile they fall in, so they flow through the same contraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from dmltrain.losses._rowwise import (
    _CHUNK_BYTES_PER_ELEMENT,
    _ROW_BYTES_PER_ELEMENT,
    BlockResult,
    Metric,
    PositiveSets,
)


@dataclass
class RowGroup:
    """A block of consecutive queries, their padded positives and the positives' similarity values."""

    rows: slice  # the block's rows among all queries
    queries: Tensor  # (k, D)
    sq_norms: Tensor | None  # (k, 1) squared norms for "sqeuclidean", else None
    labels: Tensor  # (k,)
    self_col: Tensor  # (k,) the query's own reference column, -1 if it is not in the reference set
    pos_cols: Tensor  # (k, P) positive columns, padded (padding repeats valid columns)
    pos_real: Tensor  # (k, P) bool: the slot is a real positive
    pos_values: Tensor  # (k, P) similarity / squared distance of each positive (arbitrary on padding)
    n_pos: Tensor  # (k,) number of positives
    chunk_elements: int  # element budget of (rows x positives x tile) slabs

    def slab_steps(self, tile_width: int) -> tuple[int, int]:
        """Rows and positives per ``(rows x positives x tile)`` slab within the chunk budget."""
        positives = max(self.pos_cols.shape[1], 1)
        per_row = positives * max(tile_width, 1)
        if per_row <= self.chunk_elements:
            return max(1, self.chunk_elements // per_row), positives
        return 1, max(1, self.chunk_elements // max(tile_width, 1))


@dataclass
class ColumnTile:
    """One tile of reference columns, as seen by one `RowGroup`."""

    values: Tensor  # (k, T) similarities ("dot") or squared distances ("sqeuclidean")
    cols: slice
    ref_labels: Tensor  # (T,)

    def same_label(self, group: RowGroup) -> Tensor:
        """(k, T) bool: the column shares the query's label (the query's own column included)."""
        return self.ref_labels[None, :] == group.labels[:, None]

    def self_hits(self, group: RowGroup) -> tuple[Tensor, Tensor]:
        """(rows, tile columns) of the queries whose own column lies in this tile."""
        inside = (group.self_col >= self.cols.start) & (group.self_col < self.cols.stop)
        rows = torch.nonzero(inside).squeeze(1)
        return rows, group.self_col[rows] - self.cols.start

    def positive_hits(self, group: RowGroup) -> tuple[Tensor, Tensor, Tensor]:
        """(rows, positive slots, tile columns) of the real positives that lie in this tile."""
        inside = group.pos_real & (group.pos_cols >= self.cols.start) & (group.pos_cols < self.cols.stop)
        rows, slots = torch.nonzero(inside, as_tuple=True)
        return rows, slots, group.pos_cols[rows, slots] - self.cols.start

    def add_at_positives(self, group: RowGroup, jac: Tensor, pos_grad: Tensor) -> None:
        """``jac[q, column of positive s] += pos_grad[q, s]`` for the positives in this tile.

        Positives of a query are distinct columns, so an indexed assignment is exact and deterministic.
        """
        rows, slots, local = self.positive_hits(group)
        if rows.numel():
            jac[rows, local] = jac[rows, local] + pos_grad[rows, slots]


class StreamKernel(Protocol):
    """A loss's per-row statistics over column tiles, and the Jacobian of one tile from them."""

    metric: Metric

    def passes(self) -> int:
        """Walks over the tiles the forward needs (2 when a row maximum must be known first)."""
        ...

    def start(self, group: RowGroup) -> Any: ...

    def add_tile(self, state: Any, group: RowGroup, tile: ColumnTile, walk: int) -> None: ...

    def finish(self, state: Any, group: RowGroup) -> BlockResult: ...

    def jacobian(self, state: Any, group: RowGroup, tile: ColumnTile) -> Tensor:
        """(k, T) dt_q / dvalues for this tile, the positives' own entries included."""
        ...


def tiling(n_q: int, n_ref: int, budget_bytes: int) -> tuple[int, int]:
    """(rows per group, columns per tile): a near-square block within the budget, no larger than needed."""
    elements = max(1, budget_bytes // _ROW_BYTES_PER_ELEMENT)
    side = max(1, math.isqrt(elements))
    if n_ref <= side:
        return min(n_q, max(1, elements // max(n_ref, 1))), n_ref
    if n_q <= side:
        return n_q, min(n_ref, max(1, elements // n_q))
    return side, min(n_ref, max(1, elements // side))


def _tile_values(group: RowGroup, refs: Tensor, sq_ref: Tensor | None, cols: slice) -> Tensor:
    values = group.queries @ refs[cols].T
    if sq_ref is not None:
        assert group.sq_norms is not None
        values = values.mul_(-2).add_(group.sq_norms).add_(sq_ref[cols]).clamp_(min=0)
    return values


def _positive_values(
    queries: Tensor, sq_norms: Tensor | None, refs: Tensor, sq_ref: Tensor | None, cols: Tensor, chunk: int
) -> Tensor:
    """Values of the (padded) positive columns, computed directly in row chunks of the element budget."""
    k, width = cols.shape
    out = torch.empty(k, width, dtype=queries.dtype, device=queries.device)
    if width == 0 or k == 0:
        return out
    step = max(1, chunk // (width * max(queries.shape[1], 1)))
    for i in range(0, k, step):
        c = cols[i : i + step]
        dots = torch.bmm(refs[c], queries[i : i + step, :, None]).squeeze(2)
        if sq_ref is not None:
            assert sq_norms is not None
            dots = dots.mul_(-2).add_(sq_norms[i : i + step]).add_(sq_ref[c]).clamp_(min=0)
        out[i : i + step] = dots
    return out


class _StreamedFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        queries: Tensor,
        refs: Tensor,
        query_labels: Tensor,
        ref_labels: Tensor,
        self_col: Tensor,
        kernel: StreamKernel,
        budget_bytes: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        keep = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        n_q, n_ref = queries.shape[0], refs.shape[0]
        dtype, device = queries.dtype, queries.device
        terms = torch.zeros(n_q, dtype=dtype, device=device)
        valid = torch.zeros(n_q, dtype=torch.bool, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        sq_ref = refs.pow(2).sum(1) if kernel.metric == "sqeuclidean" else None
        rows_per_group, cols_per_tile = tiling(n_q, n_ref, budget_bytes)
        chunk_elements = max(1, budget_bytes // _CHUNK_BYTES_PER_ELEMENT)
        groups: list[tuple[RowGroup, Any]] = []
        if n_q and n_ref:
            positives = PositiveSets(query_labels, ref_labels, self_col)
            for start in range(0, n_q, rows_per_group):
                rows = slice(start, min(n_q, start + rows_per_group))
                group = _row_group(
                    queries, refs, sq_ref, query_labels, self_col, positives, rows, chunk_elements
                )
                state = kernel.start(group)
                for walk in range(kernel.passes()):
                    for c in range(0, n_ref, cols_per_tile):
                        cols = slice(c, min(n_ref, c + cols_per_tile))
                        tile = ColumnTile(_tile_values(group, refs, sq_ref, cols), cols, ref_labels[cols])
                        kernel.add_tile(state, group, tile, walk)
                result = kernel.finish(state, group)
                terms[rows] = result.terms
                valid[rows] = result.valid
                count += result.count.to(torch.float64)
                if keep:
                    groups.append((group, state))
        ctx.kernel, ctx.groups, ctx.cols_per_tile = kernel, groups, cols_per_tile
        ctx.save_for_backward(queries, refs, ref_labels)
        num_valid = valid.sum()
        count = count.to(dtype)
        ctx.mark_non_differentiable(count, num_valid)
        return terms, count, num_valid

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_terms: Tensor, _grad_count: Tensor, _grad_valid: Tensor):  # type: ignore[override]
        queries, refs, ref_labels = ctx.saved_tensors
        kernel: StreamKernel = ctx.kernel
        need_q, need_r = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_q = torch.zeros_like(queries) if need_q else None
        grad_r = torch.zeros_like(refs) if need_r else None
        sq_metric = kernel.metric == "sqeuclidean"
        sq_ref = refs.pow(2).sum(1) if sq_metric else None
        scale = -2.0 if sq_metric else 1.0
        n_ref = refs.shape[0]
        for group, state in ctx.groups:
            g = grad_terms[group.rows, None]
            q_scaled = group.queries * g
            for c in range(0, n_ref, ctx.cols_per_tile):
                cols = slice(c, min(n_ref, c + ctx.cols_per_tile))
                tile = ColumnTile(_tile_values(group, refs, sq_ref, cols), cols, ref_labels[cols])
                jac = kernel.jacobian(state, group, tile)
                del tile
                # values = q.r ("dot") or |q|^2 + |r|^2 - 2 q.r: dL/dq = (g J) R (x -2) (+ 2 q sum_j g J).
                if grad_q is not None:
                    grad_q[group.rows] += torch.mm(jac, refs[cols]).mul_(g * scale)
                    if sq_metric:
                        grad_q[group.rows] += group.queries * (jac.sum(1, keepdim=True) * g * 2.0)
                if grad_r is not None:
                    grad_r[cols].addmm_(jac.T, q_scaled, alpha=scale)
                    if sq_metric:
                        grad_r[cols] += 2.0 * refs[cols] * torch.mv(jac.T, g.squeeze(1))[:, None]
        return grad_q, grad_r, None, None, None, None, None


def _row_group(
    queries: Tensor,
    refs: Tensor,
    sq_ref: Tensor | None,
    query_labels: Tensor,
    self_col: Tensor,
    positives: PositiveSets,
    rows: slice,
    chunk_elements: int,
) -> RowGroup:
    q = queries[rows]
    sq_norms = q.pow(2).sum(1, keepdim=True) if sq_ref is not None else None
    pos_cols, pos_real = positives.padded(torch.arange(rows.start, rows.stop, device=queries.device))
    return RowGroup(
        rows=rows,
        queries=q,
        sq_norms=sq_norms,
        labels=query_labels[rows],
        self_col=self_col[rows],
        pos_cols=pos_cols,
        pos_real=pos_real,
        pos_values=_positive_values(q, sq_norms, refs, sq_ref, pos_cols, chunk_elements),
        n_pos=positives.counts[rows],
        chunk_elements=chunk_elements,
    )


def streamed_terms(
    queries: Tensor,
    refs: Tensor,
    query_labels: Tensor,
    ref_labels: Tensor,
    self_col: Tensor,
    kernel: StreamKernel,
    budget_bytes: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Same contract as `rowwise_terms`, keeping only per-row statistics between forward and backward."""
    return _StreamedFunction.apply(queries, refs, query_labels, ref_labels, self_col, kernel, budget_bytes)
