"""Block-wise evaluation of row-decomposable ranking losses with a saved per-row Jacobian.

Every loss in this package is a sum of per-query terms ``t_q`` where ``t_q`` depends only on row ``q`` of the
query-vs-reference similarity matrix ``S = Q R^T`` (or of the squared-distance matrix built from it). Hence
``dt_q/dS`` is non-zero only in row ``q``. The forward pass walks over blocks of query rows, lets a loss
*kernel* compute the terms and the row Jacobian ``J[q, :] = dt_q / dS[q, :]`` in closed form, and keeps only
``J`` (``B_q x N``). The backward pass scales row ``q`` by the incoming gradient of ``t_q`` and does two
matmuls. No autograd graph over ``B x B`` intermediates (let alone ``B x K x B`` or ``B^3``) is ever built,
so memory is ``O(B_q N)`` plus one bounded block of temporaries.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor

Metric = Literal["dot", "sqeuclidean"]

# Rough bytes of temporaries per element of a (rows x N) block and of a (rows x positives x N) chunk; used
# to turn the memory budget into block sizes. On CPU, blocks of a few MB stay cache-resident and never
# page-fault fresh buffers (glibc maps allocations above 32 MB afresh each time), which makes blocking
# *faster* than whole-matrix ops; but every op is an OpenMP region, and on an oversubscribed CPU each region
# can stall for a scheduler slice, so blocks should not be tiny either. The default budget balances both.
_ROW_BYTES_PER_ELEMENT = 48
_CHUNK_BYTES_PER_ELEMENT = 40


class PositiveSets:
    """Positives of every query in the reference set, without building a dense ``B x B`` index.

    References are sorted by label once; the positives of a query are a contiguous range of that order minus
    the query's own row. Queries are processed in groups with equal positive counts so that per-positive
    work is a dense ``(queries x n x N)`` tensor for any label layout (unequal classes, singletons).
    """

    def __init__(self, query_labels: Tensor, ref_labels: Tensor, self_col: Tensor) -> None:
        self._order = torch.argsort(ref_labels, stable=True)
        sorted_labels = ref_labels[self._order].contiguous()
        self._start = torch.searchsorted(sorted_labels, query_labels.contiguous(), right=False)
        end = torch.searchsorted(sorted_labels, query_labels.contiguous(), right=True)
        has_self = self_col >= 0
        self._self_col = self_col
        self._with_self = bool(has_self.any().item()) if self_col.numel() else False
        self.counts = end - self._start - has_self.long()

    def padded(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Positive columns of each query in ``rows``, padded to the largest count: ``(cols, is_real)``.

        Padding slots hold arbitrary (possibly repeated) valid column indices; mask them with ``is_real``.
        """
        counts = self.counts[rows]
        width = int(counts.max().item()) if rows.numel() else 0
        extra = 1 if self._with_self else 0
        slots = torch.arange(width + extra, device=rows.device)
        in_range = slots[None, :] < (counts + extra)[:, None]
        last = self._order.numel() - 1
        candidates = self._order[(self._start[rows, None] + slots).clamp_(max=last)]
        real = in_range
        if extra:
            real = real & (candidates != self._self_col[rows, None])
            # drop the self slot: stable-sort real entries first, keep `width` columns
            order = torch.argsort((~real).to(torch.int8), dim=1, stable=True)[:, :width]
            candidates, real = candidates.gather(1, order), real.gather(1, order)
        return candidates, real

    def indices(self, rows: Tensor, n: int) -> Tensor:
        """Reference columns of the ``n`` positives of each query in ``rows`` (all with count ``n``)."""
        extra = 1 if self._with_self else 0
        offsets = torch.arange(n + extra, device=rows.device)
        candidates = self._order[self._start[rows, None] + offsets]
        if extra:
            keep = candidates != self._self_col[rows, None]
            candidates = candidates[keep].view(rows.numel(), n)
        return candidates


@dataclass
class QueryBlock:
    """One block of consecutive query rows, as handed to a kernel."""

    values: Tensor  # (Qc, N) similarities ("dot") or squared distances ("sqeuclidean"), compute dtype
    labels: Tensor  # (Qc,) query labels
    ref_labels: Tensor  # (N,) reference labels
    self_col: Tensor  # (Qc,) column of each query inside the reference set, -1 if it is not there
    rows: slice  # the block's rows among all queries
    positives: PositiveSets | None  # only built for kernels that ask for it
    chunk_elements: int  # element budget for (rows x positives x N) chunks
    jacobian: Tensor | None  # (Qc, N) uninitialised output for dt_q/dvalues (write every entry), or None

    def same_label(self) -> Tensor:
        """(Qc, N) bool: reference shares the query's label (the query's own row included)."""
        return self.ref_labels[None, :] == self.labels[:, None]

    def positive_mask(self) -> Tensor:
        """(Qc, N) bool: positives of each query, its own row excluded."""
        mask = self.same_label()
        self.zero_self(mask)
        return mask

    def zero_self(self, tensor: Tensor) -> None:
        """Zero (in place) the query's own column in a (Qc, N) tensor."""
        rows = torch.nonzero(self.self_col >= 0).squeeze(1)
        if rows.numel():
            tensor[rows, self.self_col[rows]] = 0

    def positive_chunks(self) -> Iterator[tuple[int, slice | Tensor, Tensor, Tensor]]:
        """Yield ``(n, rows, cols, all_cols)`` for block rows whose queries have ``n >= 1`` positives.

        ``rows`` indexes the block's rows: a slice when they are consecutive (then ``tensor[rows]`` is a view
        that can be updated in place), else an index tensor.

        ``all_cols`` (``len(rows) x n``) are all their positives' columns and ``cols`` the ones to process
        now: all of them, or ``nc < n`` of them when a single query's ``n x N`` slab exceeds the chunk budget
        (a huge class).
        """
        assert self.positives is not None
        counts = self.positives.counts[self.rows]
        n_ref = self.values.shape[1]
        for n in torch.unique(counts).tolist():
            if n <= 0:
                continue
            rows = torch.nonzero(counts == n).squeeze(1)
            per_query = n * n_ref
            if per_query <= self.chunk_elements:
                step = max(1, self.chunk_elements // per_query)
                for i in range(0, rows.numel(), step):
                    sub = rows[i : i + step]
                    cols = self.positives.indices(sub + self.rows.start, n)
                    yield n, _as_slice(sub), cols, cols
            else:
                pos_step = max(1, self.chunk_elements // max(n_ref, 1))
                for i in range(rows.numel()):
                    sub = rows[i : i + 1]
                    cols = self.positives.indices(sub + self.rows.start, n)
                    for j in range(0, n, pos_step):
                        yield n, _as_slice(sub), cols[:, j : j + pos_step], cols


def _as_slice(rows: Tensor) -> slice | Tensor:
    """A sorted index tensor as a slice when it is a consecutive run (views instead of copies)."""
    first, last = int(rows[0].item()), int(rows[-1].item())
    return slice(first, last + 1) if last - first + 1 == rows.numel() else rows


def add_at_columns(rows_tensor: Tensor, cols: Tensor, values: Tensor, where: Tensor | None = None) -> None:
    """``rows_tensor[i, cols[i, c]] += values[i, c]`` for columns distinct within each row.

    Gather + indexed assignment instead of ``scatter_add_``: with distinct columns this is exact and
    deterministic on every device, also under ``torch.use_deterministic_algorithms(True)`` on CUDA. Entries
    with ``where`` False are skipped (padding slots may repeat a column).
    """
    if where is None:
        row_ids = torch.arange(rows_tensor.shape[0], device=cols.device)[:, None].expand_as(cols)
        rows_tensor[row_ids, cols] = rows_tensor[row_ids, cols] + values
        return
    row_ids, slot = torch.nonzero(where, as_tuple=True)
    col_ids = cols[row_ids, slot]
    rows_tensor[row_ids, col_ids] = rows_tensor[row_ids, col_ids] + values[row_ids, slot]


@dataclass
class BlockResult:
    """What a kernel returns for one block (the Jacobian goes into ``QueryBlock.jacobian``)."""

    terms: Tensor  # (Qc,) per-query loss terms
    count: Tensor  # 0-dim: this block's contribution to the normaliser
    valid: Tensor  # (Qc,) bool: the query carried a signal


class RowKernel(Protocol):
    """A loss's per-block computation: terms, normaliser and (optionally) dt_q/dvalues."""

    metric: Metric
    needs_positive_sets: bool

    def __call__(self, block: QueryBlock) -> BlockResult: ...


class _RowwiseFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        queries: Tensor,
        refs: Tensor,
        query_labels: Tensor,
        ref_labels: Tensor,
        self_col: Tensor,
        kernel: RowKernel,
        budget_bytes: int,
    ) -> tuple[Tensor, Tensor, Tensor]:
        need_jacobian = bool(ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        n_q, n_ref = queries.shape[0], refs.shape[0]
        dtype, device = queries.dtype, queries.device
        terms = torch.zeros(n_q, dtype=dtype, device=device)
        valid = torch.zeros(n_q, dtype=torch.bool, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        jacobian = torch.empty(n_q, n_ref, dtype=dtype, device=device) if need_jacobian else None
        if n_q and n_ref:
            positives = (
                PositiveSets(query_labels, ref_labels, self_col) if kernel.needs_positive_sets else None
            )
            sq_ref = refs.pow(2).sum(1) if kernel.metric == "sqeuclidean" else None
            rows_per_block = max(1, budget_bytes // (_ROW_BYTES_PER_ELEMENT * n_ref))
            chunk_elements = max(1, budget_bytes // _CHUNK_BYTES_PER_ELEMENT)
            for start in range(0, n_q, rows_per_block):
                rows = slice(start, min(n_q, start + rows_per_block))
                values = queries[rows] @ refs.T
                if sq_ref is not None:
                    sq_q = queries[rows].pow(2).sum(1, keepdim=True)
                    values = values.mul_(-2).add_(sq_q).add_(sq_ref).clamp_(min=0)
                block = QueryBlock(
                    values=values,
                    labels=query_labels[rows],
                    ref_labels=ref_labels,
                    self_col=self_col[rows],
                    rows=rows,
                    positives=positives,
                    chunk_elements=chunk_elements,
                    jacobian=None if jacobian is None else jacobian[rows],
                )
                result = kernel(block)
                terms[rows] = result.terms
                valid[rows] = result.valid
                count += result.count.to(torch.float64)
        ctx.metric = kernel.metric
        ctx.budget_bytes = budget_bytes
        ctx.save_for_backward(queries, refs, jacobian)
        num_valid = valid.sum()
        count = count.to(dtype)
        ctx.mark_non_differentiable(count, num_valid)
        return terms, count, num_valid

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_terms: Tensor, _grad_count: Tensor, _grad_valid: Tensor):  # type: ignore[override]
        queries, refs, jacobian = ctx.saved_tensors
        need_q, need_r = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_q = torch.zeros_like(queries) if need_q else None
        grad_r = torch.zeros_like(refs) if need_r else None
        n_q, n_ref = jacobian.shape
        if n_q == 0 or n_ref == 0:
            return grad_q, grad_r, None, None, None, None, None
        sq_metric = ctx.metric == "sqeuclidean"
        col_sums = torch.zeros(n_ref, dtype=refs.dtype, device=refs.device) if sq_metric else None
        # dL/dvalues = grad_terms[:, None] * J. The row scaling is applied to the (rows x D) operands and
        # results instead of to J, so backward makes no (rows x N) temporary at all. For "sqeuclidean",
        # values = |q|^2 + |r|^2 - 2 q.r adds the norm terms. Blocks of ~1/16 of the budget suit matmuls.
        scale = -2.0 if sq_metric else 1.0
        rows_per_block = max(1, ctx.budget_bytes // (16 * n_ref))
        for start in range(0, n_q, rows_per_block):
            rows = slice(start, min(n_q, start + rows_per_block))
            jac, g = jacobian[rows], grad_terms[rows, None]
            if grad_q is not None:
                grad_q[rows] = torch.mm(jac, refs).mul_(g * scale)
                if sq_metric:
                    grad_q[rows] += queries[rows] * (jac.sum(1, keepdim=True) * g * 2.0)
            if grad_r is not None:
                grad_r.addmm_(jac.T, queries[rows] * g, alpha=scale)
                if col_sums is not None:
                    col_sums += torch.mv(jac.T, g.squeeze(1))
        if grad_r is not None and col_sums is not None:
            grad_r += 2.0 * refs * col_sums[:, None]
        return grad_q, grad_r, None, None, None, None, None


def rowwise_terms(
    queries: Tensor,
    refs: Tensor,
    query_labels: Tensor,
    ref_labels: Tensor,
    self_col: Tensor,
    kernel: RowKernel,
    budget_bytes: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-query terms (differentiable), the normaliser and the number of valid queries.

    Inputs must already be in the compute dtype; ``self_col[i]`` is the reference row of query ``i`` (excluded
    from its retrieval set) or -1.
    """
    return _RowwiseFunction.apply(queries, refs, query_labels, ref_labels, self_col, kernel, budget_bytes)
