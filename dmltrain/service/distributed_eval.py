"""Evaluation during training: every worker embeds its part of each test split, rank 0 scores the union.

Splitting the embedding work keeps evaluation as parallel as training; the metrics themselves need the
whole split in one place, so embeddings (B x D floats, small next to the images) are gathered. For the
retrieval-grid plot each rank keeps tiny thumbnails of its own images and sends only those the grid shows.
A run evaluates the same images many times through a deterministic test transform, so each worker keeps
its part of a split, decoded, after the first evaluation when it fits ``eval.cache_mb``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dmltrain.data import DatasetInfo, EvalLoader
from dmltrain.distributed import (
    all_gather_objects,
    all_gather_sizes,
    all_reduce_sum_,
    broadcast_object,
    gather_uneven,
)
from dmltrain.evaluation import nearest_neighbors, retrieval_metrics
from dmltrain.index import approximate_retrieval_metrics
from dmltrain.inference import embed_batch
from dmltrain.models import PreprocessConfig
from dmltrain.service.builders import resolve_preprocessing
from dmltrain.service.config import recall_ks
from dmltrain.service.errors import NonFiniteEmbeddingsError
from dmltrain.service.logs import progress_bar

if TYPE_CHECKING:
    from dmltrain.service.config import ExperimentConfig
    from dmltrain.service.tracking import RunLogger

THUMBNAIL_SIZE = 48
log = logging.getLogger(__name__)

# uint8 images after the test transform, labels, the shard each image came from
Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class EvalImageCache:
    """This worker's test images after the test transform, kept from the first evaluation of each split.

    Later evaluations embed the same batches in the same order without reading or decoding a shard (about
    a quarter of an evaluation's time in the quickstart on 2 cores; more where a GPU embeds faster than
    the loaders decode).
    Splits are kept while their sum fits ``budget_bytes``; one that does not is streamed every time.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._splits: dict[str, list[Batch]] = {}
        self._streamed: set[str] = set()

    def batches(self, split: str) -> list[Batch] | None:
        return self._splits.get(split)

    def collect(self, split: str, batches: Iterator[Batch]) -> Iterator[Batch]:
        """Pass ``batches`` through, keeping copies; once the whole split has passed, store it if it fit."""
        if split in self._splits or split in self._streamed or self.budget_bytes <= 0:
            yield from batches
            return
        kept: list[Batch] | None = []
        size = 0
        for images, labels, shards in batches:
            if kept is not None:
                size += images.nbytes + labels.nbytes + shards.nbytes
                if self.used_bytes + size <= self.budget_bytes:
                    # a copy: a loader process's batch lives in shared memory, one file descriptor each
                    kept.append((images.clone(), labels.clone(), shards.clone()))
                else:
                    kept = None
            yield images, labels, shards
        if kept is None:
            self._streamed.add(split)
            log.info(
                "evaluation: the %s split's images take more than eval.cache_mb (%d MB) on this worker: read "
                "from the shards at every evaluation",
                split,
                self.budget_bytes >> 20,
            )
        else:
            self._splits[split] = kept
            self.used_bytes += size


@dataclass
class EmbeddedSplit:
    """A split's embeddings and labels in rank order, each rank's rows in shard order: the whole split on
    rank 0, none on the others (which keep ``sizes`` and the thumbnails of their own rows)."""

    embeddings: torch.Tensor
    labels: torch.Tensor
    sizes: list[int]
    thumbnails: dict[int, np.ndarray] = field(default_factory=dict)  # this rank's rows only, global index


def _thumbnail(images: torch.Tensor) -> torch.Tensor:
    if images.shape[-1] <= THUMBNAIL_SIZE:
        return images
    return F.interpolate(images.float(), size=THUMBNAIL_SIZE, mode="bilinear", antialias=True).round().byte()


@torch.no_grad()
def embed_split(
    net: nn.Module,
    config: ExperimentConfig,
    info: DatasetInfo,
    split: str,
    device: torch.device,
    rank: int,
    world: int,
    keep_thumbnails: bool,
    autocast_dtype: torch.dtype | None = None,
    preprocessing: PreprocessConfig | None = None,
    cache: EvalImageCache | None = None,
) -> EmbeddedSplit:
    """Embed this rank's shards of ``split`` and gather every rank's rows (in rank order).

    ``preprocessing`` is the run's resolved test-time preprocessing (default: resolved from the config);
    ``cache`` keeps the decoded images for the next evaluation (the same preprocessing every time).
    Each rank's rows come back in shard order, not in the order loader workers delivered them, so the
    retrieval grid (which picks queries by position) shows the same ones whatever ``data.loader_workers``.
    """
    if preprocessing is None:
        preprocessing = resolve_preprocessing(config)
    normalize = preprocessing.normalizer()
    batches: Iterator[Batch]
    cached = cache.batches(split) if cache is not None else None
    if cached is not None:
        batches, total = iter(cached), sum(len(batch_labels) for _, batch_labels, _ in cached)
    else:
        loader = EvalLoader(
            config.data.root,
            split,
            config.eval.batch_size,
            rank=rank,
            world_size=world,
            num_workers=config.data.loader_workers,
            transform=preprocessing.test_transform(),
            info=info,
            max_images=None if config.eval.max_images is None else config.eval.max_images // world,
            with_shards=True,
        )
        batches = (
            (images, labels, torch.as_tensor(shards, dtype=torch.int32))
            for images, labels, _categories, _keys, shards in loader
        )
        total = loader.num_samples
        if cache is not None:
            batches = cache.collect(split, batches)
    was_training = net.training
    net.eval()
    chunks, labels, shards, thumbs = [], [], [], []
    progress = progress_bar(total, f"embed {split}", enabled=rank == 0)
    for images, batch_labels, batch_shards in batches:
        chunks.append(embed_batch(net, images, device, autocast_dtype, normalize))
        labels.append(batch_labels)
        shards.append(batch_shards)
        if keep_thumbnails:
            thumbs.append(_thumbnail(images))
        progress.update(len(images))
    progress.close()
    net.train(was_training)
    dim = config.model.embedding_dim
    local = torch.cat(chunks) if chunks else torch.empty(0, dim, device=device)
    local_labels = torch.cat(labels) if labels else torch.empty(0, dtype=torch.int64)
    # a shard is read by one loader worker, front to back: a stable sort by shard is the shard order
    order = torch.argsort(torch.cat(shards), stable=True) if shards else torch.empty(0, dtype=torch.int64)
    local, local_labels = local[order.to(local.device)], local_labels[order]
    sizes = all_gather_sizes(len(local), device)
    offset = sum(sizes[:rank])
    thumbnails: dict[int, np.ndarray] = {}
    if keep_thumbnails and thumbs:
        stacked = torch.cat(thumbs)[order].permute(0, 2, 3, 1).numpy()
        thumbnails = {offset + i: stacked[i] for i in range(len(stacked))}
    # Counted over every rank, so all of them stop here together: only rank 0 receives the gathered rows,
    # and a rank that went on alone would wait in the next collective until the group is torn down.
    broken = torch.tensor([int((~torch.isfinite(local).all(dim=1)).sum()), len(local)], device=device)
    broken, images = (int(n) for n in all_reduce_sum_(broken).tolist())
    if broken:
        raise NonFiniteEmbeddingsError(
            f"the network embeds {broken} of {images} images of split {split!r} as NaN or inf (diverged "
            "weights, or inputs that overflow: data.mean, data.std)"
        )
    embeddings = gather_uneven(local, sizes).cpu()  # rank 0 scores; the others need only their thumbnails
    return EmbeddedSplit(embeddings, gather_uneven(local_labels.to(device), sizes).cpu(), sizes, thumbnails)


def index_kind(config: ExperimentConfig, gallery_size: int) -> str:
    """``exact`` (ranked by blocked matmuls, every metric) or the faiss kind to evaluate with."""
    kind = config.eval.index
    if kind == "auto":
        return "exact" if gallery_size <= config.eval.exact_max_gallery else "ivfpq"
    return kind


def _metrics(
    config: ExperimentConfig, ks: tuple[int, ...], q: EmbeddedSplit, g: EmbeddedSplit | None
) -> dict[str, float]:
    """Exact metrics, or k-NN metrics from a faiss index with its recall against exact search."""
    gallery = q if g is None else g
    kind = index_kind(config, len(gallery.labels))
    g_emb, g_lab = (None, None) if g is None else (g.embeddings, g.labels)
    if kind == "exact":
        return retrieval_metrics(q.embeddings, q.labels, g_emb, g_lab, ks)
    return approximate_retrieval_metrics(
        q.embeddings,
        q.labels,
        g_emb,
        g_lab,
        ks,
        kind=kind,  # type: ignore[arg-type]
        recall_queries=config.eval.index_recall_queries,
    )


def _gather_thumbnails(wanted: list[int], mine: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """Rank 0 names the rows the grid shows; every rank contributes the ones it holds."""
    wanted = broadcast_object(wanted)
    parts = all_gather_objects({i: mine[i] for i in wanted if i in mine})
    return {k: v for part in parts for k, v in part.items()}


def evaluate(
    net: nn.Module,
    config: ExperimentConfig,
    info: DatasetInfo,
    device: torch.device,
    rank: int,
    world: int,
    logger: RunLogger | None,
    step: int,
    autocast_dtype: torch.dtype | None = None,
    preprocessing: PreprocessConfig | None = None,
    cache: EvalImageCache | None = None,
) -> dict[str, float]:
    """Run the dataset's evaluations (dataset.json ``evaluations``); rank 0 returns and plots metrics.

    A training run passes the same ``cache`` (and preprocessing) to every evaluation."""
    from dmltrain.plots import recall_at_k_curve

    want_grid = config.eval.grid_queries > 0
    embedded = {
        split: embed_split(
            net, config, info, split, device, rank, world, want_grid, autocast_dtype, preprocessing, cache
        )
        for split in info.evaluated_splits
    }
    metrics: dict[str, float] = {}
    curves: dict[str, dict[str, float]] = {}
    for ev in info.evaluations:
        q = embedded[ev.query]
        g = embedded[ev.gallery] if ev.gallery else None
        if rank == 0:
            result = _metrics(config, recall_ks(config, info.recall_ks), q, g)
            curves[ev.name] = result
            metrics.update({f"eval/{ev.name}/{k}": v for k, v in result.items()})
    if want_grid:
        first = info.evaluations[0]
        _log_grid(
            embedded[first.query],
            embedded[first.gallery] if first.gallery else None,
            config.eval.grid_queries,
            rank,
            logger,
            step,
        )
    if rank == 0 and logger is not None and curves:
        figure = recall_at_k_curve({f"{name} @ step {step}": m for name, m in curves.items()})
        logger.log_figure(figure, f"plots/recall_at_k/step_{step:07d}.png")
    return metrics


def _log_grid(
    queries: EmbeddedSplit,
    gallery: EmbeddedSplit | None,
    num_queries: int,
    rank: int,
    logger: RunLogger | None,
    step: int,
    k: int = 5,
) -> None:
    """Queries spread evenly over the split, with their top-k retrievals marked right/wrong."""
    from dmltrain.plots import retrieval_grid

    n = len(queries.labels)
    picks = np.linspace(0, n - 1, num=min(num_queries, n)).round().astype(int).tolist() if n else []
    neighbors = np.empty((0, k), dtype=np.int64)
    if rank == 0 and picks:
        if gallery is None:
            neighbors, _ = nearest_neighbors(
                queries.embeddings[picks], queries.embeddings, k, self_indices=np.asarray(picks)
            )
        else:
            neighbors, _ = nearest_neighbors(queries.embeddings[picks], gallery.embeddings, k)
    retrieved = sorted({int(i) for i in neighbors.ravel() if i >= 0})
    if gallery is None:  # leave-one-out: queries and retrievals come from the same split
        query_thumbs = gallery_thumbs = _gather_thumbnails(
            sorted(set(picks) | set(retrieved)), queries.thumbnails
        )
    else:
        query_thumbs = _gather_thumbnails(picks if rank == 0 else [], queries.thumbnails)
        gallery_thumbs = _gather_thumbnails(retrieved, gallery.thumbnails)
    if rank != 0 or logger is None or not picks:
        return
    source = queries if gallery is None else gallery
    figure = retrieval_grid(
        [query_thumbs[i] for i in picks],
        queries.labels[picks].numpy(),
        neighbors,
        gallery_thumbs,
        source.labels.numpy(),
        scale=max(1, 96 // max(next(iter(query_thumbs.values())).shape[0], 1)),
    )
    logger.log_figure(figure, f"plots/retrievals/step_{step:07d}.png")
