"""Common interface of the ranking losses: in-batch retrieval, an optional explicit gallery, and `parts`.

Every loss is a sum of per-query terms divided by a normaliser. Exposing the sum and the normaliser
separately (`LossParts`) is what lets the distributed engine divide by the *globally* all-reduced normaliser,
so that the losses of row-split queries summed over ranks equal the single-process global-batch loss.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from dmltrain.losses._budget import DEFAULT_MEMORY_BUDGET_MB, memory_budgets
from dmltrain.losses._rowwise import RowKernel, rowwise_terms
from dmltrain.losses._streamed import StreamKernel, streamed_terms

__all__ = ["DEFAULT_MEMORY_BUDGET_MB", "LossParts", "RankingLoss"]

Reduction = Literal["mean", "sum", "none"]
_REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class LossParts:
    """Sum of per-query terms and its normaliser; ``total / count`` is the mean loss.

    - ``total``: scalar float tensor carrying the gradient (float32; float64 for float64 inputs).
    - ``count``: scalar float tensor without gradient: valid queries (FastAP, Smooth-AP), all queries (RLL),
      active triplets (triplet). All-reduce it across ranks before dividing.
    - ``num_queries``: queries scored in this call.
    - ``num_valid``: queries that carried a signal (see each loss's docstring); for logging.
    """

    total: Tensor
    count: Tensor
    num_queries: int
    num_valid: int

    def mean(self) -> Tensor:
        """``total / count``, and an exact 0 (with all-zero gradient) when nothing was counted."""
        return self.total / self.count.clamp(min=1)


class RankingLoss(nn.Module, ABC):
    """Base class: each row is a query, the other rows (or an explicit gallery) its retrieval set.

    Subclasses provide a `RowKernel` and a `StreamKernel`; this class validates inputs, casts to the compute
    dtype (float32, or float64 when given float64 so that `torch.autograd.gradcheck` works), runs the
    block-wise evaluation and applies the reduction.

    Memory: ``memory_budget_mb`` bounds one block's temporaries (None: 64 MB on CPU; on CUDA 1/8 of the
    device's available memory within [64 MB, 2 GB]). ``saved_budget_mb`` bounds what is kept for backward,
    the ``queries x references`` Jacobian; above it the loss streams column tiles and recomputes them in
    backward (same values and gradients up to float rounding, about twice the similarity work). None: the
    host's available memory on CPU (so CPU calls that fit behave as before), half the device's available
    memory on CUDA.
    """

    def __init__(
        self, *, memory_budget_mb: float | None = None, saved_budget_mb: float | None = None
    ) -> None:
        super().__init__()
        for name, value in (("memory_budget_mb", memory_budget_mb), ("saved_budget_mb", saved_budget_mb)):
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is not None and not (number and value > 0):
                raise ValueError(f"{name} must be positive or None (device default), got {value!r}")
        self.memory_budget_mb = None if memory_budget_mb is None else float(memory_budget_mb)
        self.saved_budget_mb = None if saved_budget_mb is None else float(saved_budget_mb)

    @abstractmethod
    def _kernel(self) -> RowKernel:
        """The per-block computation with the loss's current hyper-parameters."""

    @abstractmethod
    def _stream_kernel(self) -> StreamKernel:
        """The column-streamed form of the same computation (used when the Jacobian would not fit)."""

    def streams(self, num_queries: int, num_refs: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether a differentiable call of this size on ``device`` would stream column tiles."""
        _, saved = memory_budgets(device, self.memory_budget_mb, self.saved_budget_mb)
        return num_queries * num_refs * _compute_dtype(dtype).itemsize > saved

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        query_index: Tensor | None = None,
        reduction: Reduction = "mean",
    ) -> Tensor:
        """Loss of the queries ``embeddings`` against the reference set (default: the batch itself).

        With ``ref_embeddings``/``ref_labels``, ``query_index[i]`` is the row of query ``i`` in the reference
        set and is left out of its retrieval set (omit it when the queries are not in the reference set).
        ``reduction="none"`` returns the per-query terms ``t`` with ``mean == t.sum() / parts.count`` (see
        the loss's docstring for what a term is); ``"sum"`` returns ``t.sum()``. Malformed or non-finite
        input raises ``ValueError`` naming the argument, rather than producing a NaN loss.
        """
        if reduction not in _REDUCTIONS:
            raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        terms, count, _ = self._evaluate(embeddings, labels, ref_embeddings, ref_labels, query_index)
        if reduction == "none":
            return terms
        total = terms.sum()
        if reduction == "sum":
            return total
        return total / count.clamp(min=1)

    def parts(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        query_index: Tensor | None = None,
    ) -> LossParts:
        """Sum of terms and normaliser, for dividing by a count all-reduced across ranks."""
        terms, count, num_valid = self._evaluate(embeddings, labels, ref_embeddings, ref_labels, query_index)
        return LossParts(
            total=terms.sum(), count=count, num_queries=int(terms.shape[0]), num_valid=int(num_valid.item())
        )

    def _evaluate(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None,
        ref_labels: Tensor | None,
        query_index: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        queries, q_labels, refs, r_labels, self_col = _validated(
            embeddings, labels, ref_embeddings, ref_labels, query_index
        )
        block, saved = memory_budgets(queries.device, self.memory_budget_mb, self.saved_budget_mb)
        differentiable = torch.is_grad_enabled() and (queries.requires_grad or refs.requires_grad)
        if differentiable and queries.shape[0] * refs.shape[0] * queries.element_size() > saved:
            kernel = self._stream_kernel()
            return streamed_terms(queries, refs, q_labels, r_labels, self_col, kernel, block)
        if not differentiable:  # the row-wise function would keep a B x N Jacobian for inputs needing grad
            queries, refs = queries.detach(), queries.detach() if refs is queries else refs.detach()
        return rowwise_terms(queries, refs, q_labels, r_labels, self_col, self._kernel(), block)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_embeddings(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (batch, dim), got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
    bad = (~torch.isfinite(x)).any(dim=1)
    if bool(bad.any().item()):
        rows = torch.nonzero(bad).squeeze(1)
        raise ValueError(
            f"{name} contain NaN or Inf in {rows.numel()} row(s) (first: {rows[:5].tolist()}); "
            "refusing to compute a loss from non-finite embeddings"
        )
    # Finite rows whose squared norms overflow the compute type give inf/NaN similarities (and FastAP's
    # histogram an index out of range): a quarter of the range leaves room for |q|^2 + |r|^2 - 2 q.r.
    dtype = _compute_dtype(x.dtype)
    norms = torch.linalg.vector_norm(x.detach(), dim=1, dtype=dtype)  # no (B, D) copy in the compute type
    huge = ~(norms <= math.sqrt(torch.finfo(dtype).max / 4))
    if bool(huge.any().item()):
        rows = torch.nonzero(huge).squeeze(1)
        raise ValueError(
            f"{name} have squared norms past {dtype}'s range in {rows.numel()} row(s) (first: "
            f"{rows[:5].tolist()}); normalise them (the losses compare cosines or squared distances)"
        )


def _check_labels(name: str, y: Tensor, n: int, emb_name: str) -> Tensor:
    if not isinstance(y, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(y).__name__}")
    if y.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(y.shape)}")
    if y.dtype == torch.bool or y.is_floating_point() or y.is_complex():
        raise ValueError(f"{name} must be an integer tensor (int64 class ids), got {y.dtype}")
    if y.shape[0] != n:
        raise ValueError(f"{name} has {y.shape[0]} entries but {emb_name} has {n} rows")
    return y.to(torch.int64)


def _validated(
    embeddings: Tensor,
    labels: Tensor,
    ref_embeddings: Tensor | None,
    ref_labels: Tensor | None,
    query_index: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Check shapes, dtypes, devices and finiteness; return compute-dtype tensors and the self column."""
    _check_embeddings("embeddings", embeddings)
    labels = _check_labels("labels", labels, embeddings.shape[0], "embeddings")
    device = embeddings.device
    if labels.device != device:
        raise ValueError(f"labels are on {labels.device} but embeddings on {device}")
    dtype = _compute_dtype(embeddings.dtype)
    queries = embeddings.to(dtype)
    if ref_embeddings is None:
        if ref_labels is not None or query_index is not None:
            raise ValueError("ref_labels / query_index given without ref_embeddings")
        self_col = torch.arange(embeddings.shape[0], device=device)
        return queries, labels, queries, labels, self_col
    if ref_labels is None:
        raise ValueError("ref_embeddings given without ref_labels")
    _check_embeddings("ref_embeddings", ref_embeddings)
    ref_labels = _check_labels("ref_labels", ref_labels, ref_embeddings.shape[0], "ref_embeddings")
    if ref_embeddings.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"ref_embeddings have dimension {ref_embeddings.shape[1]} but embeddings {embeddings.shape[1]}"
        )
    if ref_embeddings.device != device or ref_labels.device != device:
        raise ValueError("embeddings, labels, ref_embeddings and ref_labels must be on the same device")
    # Both sides in one compute dtype (the wider of the two).
    dtype = torch.promote_types(dtype, _compute_dtype(ref_embeddings.dtype))
    queries = embeddings.to(dtype)
    refs = queries if ref_embeddings is embeddings else ref_embeddings.to(dtype)
    if query_index is None:
        self_col = torch.full((embeddings.shape[0],), -1, dtype=torch.int64, device=device)
        return queries, labels, refs, ref_labels, self_col
    if not isinstance(query_index, Tensor) or query_index.dim() != 1:
        raise ValueError("query_index must be a 1-D integer tensor (row of each query in the reference set)")
    if query_index.dtype == torch.bool or query_index.is_floating_point():
        raise ValueError(f"query_index must be an integer tensor, got {query_index.dtype}")
    if query_index.shape[0] != embeddings.shape[0]:
        raise ValueError(
            f"query_index has {query_index.shape[0]} entries but embeddings has {embeddings.shape[0]} rows"
        )
    self_col = query_index.to(device=device, dtype=torch.int64)
    if self_col.numel():
        lo, hi = int(self_col.min().item()), int(self_col.max().item())
        if lo < 0 or hi >= ref_embeddings.shape[0]:
            raise ValueError(
                f"query_index values must lie in [0, {ref_embeddings.shape[0]}), got range [{lo}, {hi}]"
            )
        mismatch = ref_labels[self_col] != labels
        if bool(mismatch.any().item()):
            first = int(torch.nonzero(mismatch)[0].item())
            raise ValueError(
                f"query_index points query {first} at reference row {int(self_col[first])} whose label "
                f"{int(ref_labels[self_col[first]])} differs from the query's label {int(labels[first])}"
            )
    return queries, labels, refs, ref_labels, self_col
