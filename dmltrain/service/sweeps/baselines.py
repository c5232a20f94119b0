"""Reference points a sweep can add that involve no training: retrieval on raw pixels.

The pixels baseline embeds every test image as its normalised pixels at the run's crop size (flattened, L2
normalised) and scores it with the service's own evaluation (the data set's protocol, the same test-time
transform), so the number sits beside the trained networks on equal terms. (The untrained network needs no
run of its own: every trial evaluates it at step 0.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dmltrain.data import load_dataset_info
from dmltrain.service.config import ExperimentConfig
from dmltrain.service.distributed_eval import evaluate
from dmltrain.service.tracking import RunLogger


class PixelEmbedding(nn.Module):
    """Normalised image -> its flattened pixels, L2-normalised: retrieval with no learned features."""

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(images.flatten(1).float(), dim=1)


def pixel_baseline(config: ExperimentConfig, logger: RunLogger | None = None) -> dict[str, float]:
    """Evaluate raw pixels on every test split of ``config.data.root`` in this process (no Ray): metrics
    under their ``eval/<split>/...`` names, logged at step 0 (with the retrieval plots) when a logger is
    given."""
    info = load_dataset_info(config.data.root)
    raw = config.model_dump(mode="json")
    raw["data"]["loader_workers"] = 0
    cfg = ExperimentConfig.model_validate(raw)
    cpu = torch.device("cpu")
    metrics = evaluate(PixelEmbedding(), cfg, info, cpu, rank=0, world=1, logger=logger, step=0)
    if logger is not None:
        logger.log_metrics(metrics, 0)
    return metrics
