"""Evaluate a finished model outside training: one process, no Ray, no MLflow.

A run's final artifact ``model/model.pt`` holds the weights and the resolved config, so the network and the
image size are rebuilt exactly as trained; only the data location changes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dmltrain.data import load_dataset_info
from dmltrain.models import build_model
from dmltrain.service.config import ExperimentConfig
from dmltrain.service.distributed_eval import evaluate


def evaluate_saved_model(
    model_file: str | Path, data_root: str, batch_size: int = 128, max_images: int | None = None
) -> dict[str, float]:
    """Recall@K, mAP, MAP@R and R-precision of ``model_file`` on every evaluation ``data_root`` defines."""
    path = Path(model_file)
    if not path.is_file():
        raise FileNotFoundError(f"model file not found: {path}")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "model" not in saved or "config" not in saved:
        raise ValueError(f"{path} is not a dmltrain model file (expected keys 'model' and 'config')")
    raw = saved["config"]
    raw["data"] = {**raw["data"], "root": data_root, "prepare": None, "loader_workers": 0}
    raw["eval"] = {**raw["eval"], "batch_size": batch_size, "max_images": max_images, "grid_queries": 0}
    config = ExperimentConfig.model_validate(raw)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net = build_model(config.model.backbone, config.model.embedding_dim)
    net.load_state_dict(saved["model"])
    net.to(device)
    info = load_dataset_info(data_root)
    return evaluate(net, config, info, device, rank=0, world=1, logger=None, step=0)
