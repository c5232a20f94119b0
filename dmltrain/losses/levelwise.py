"""One ranking loss per level of a multi-level embedding, averaged (RLL Sec. 4.1.3).

RLL replaces GoogLeNet's three classifiers by three embedding layers, each with its own L2 norm and its own
ranked list loss, and concatenates the embeddings at test time. `dmltrain.models.EmbeddingNet` outputs
that concatenation as one unit vector (each level's unit embedding divided by sqrt(levels)); this wrapper
cuts it back into the levels, restores each to unit norm and applies the base loss to each.

Across ranks the engine divides the summed terms by an all-reduced normaliser, so the levels must share
it: they do for FastAP and Smooth-AP (queries with a positive) and RLL (all queries), whose normaliser is
decided by the labels alone. The triplet loss normalises by its active triplets, which differ per level,
so it is refused.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dmltrain.losses.base import LossParts, RankingLoss, Reduction
from dmltrain.losses.triplet import TripletLoss


class LevelwiseLoss(nn.Module):
    """``base`` applied to each of ``levels`` equal slices of the embedding, averaged over the levels."""

    def __init__(self, base: RankingLoss, levels: int) -> None:
        super().__init__()
        if levels < 1:
            raise ValueError(f"levels must be >= 1, got {levels}")
        if isinstance(base, TripletLoss):
            raise ValueError(
                "a multi-level embedding cannot train the triplet loss per level: its normaliser (active "
                "triplets) differs between levels; use fastap, smoothap or rll"
            )
        self.base = base
        self.levels = levels

    @property
    def gallery_is_constant(self) -> bool:
        """The base loss's answer: per level, the gallery is as constant as the base treats it (the engine
        otherwise took the gathered-gallery path, with its all-reduce, for multi-level RLL in paper form)."""
        return bool(getattr(self.base, "gallery_is_constant", False))

    def _split(self, x: Tensor | None) -> list[Tensor | None]:
        if x is None:
            return [None] * self.levels
        if x.shape[-1] % self.levels:
            raise ValueError(f"embedding dimension {x.shape[-1]} is not divisible by {self.levels} levels")
        scale = math.sqrt(self.levels)
        return [chunk * scale for chunk in x.chunk(self.levels, dim=-1)]

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        query_index: Tensor | None = None,
        reduction: Reduction = "mean",
    ) -> Tensor:
        values = [
            self.base(q, labels, r, ref_labels, query_index, reduction=reduction)
            for q, r in zip(self._split(embeddings), self._split(ref_embeddings), strict=True)
        ]
        return torch.stack(values).mean(dim=0)

    def parts(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        query_index: Tensor | None = None,
    ) -> LossParts:
        """Mean over levels of the summed terms, with the levels' (shared) normaliser."""
        parts = [
            self.base.parts(q, labels, r, ref_labels, query_index)  # type: ignore[arg-type]
            for q, r in zip(self._split(embeddings), self._split(ref_embeddings), strict=True)
        ]
        counts = {float(p.count) for p in parts}
        if len(counts) != 1:
            raise ValueError(
                f"levels disagree on the loss normaliser ({sorted(counts)}): not label-determined"
            )
        return LossParts(
            total=torch.stack([p.total for p in parts]).mean(),
            count=parts[0].count,
            num_queries=parts[0].num_queries,
            num_valid=parts[0].num_valid,
        )
