"""Evaluate a finished model outside training: one process, no Ray.

The model is found by reference (a local ``model.pt`` or MLflow model folder, ``runs:/`` or ``models:/``);
its weights file holds the resolved config and test-time preprocessing, so the network and its input
pipeline are rebuilt exactly as trained (no weights are downloaded); only the data location changes.
"""

from __future__ import annotations

from pathlib import Path

from dmltrain.data import load_dataset_info
from dmltrain.service.config import ExperimentConfig
from dmltrain.service.distributed_eval import evaluate
from dmltrain.service.serving.loading import default_decode_workers, load_embedding_model


def evaluate_saved_model(
    model: str | Path,
    data_root: str,
    batch_size: int = 128,
    max_images: int | None = None,
    *,
    tracking_uri: str | None = None,
    index: str | None = None,
    workers: int | None = None,
) -> dict[str, float]:
    """Recall@K, mAP, MAP@R and R-precision of ``model`` on every evaluation ``data_root`` defines.

    ``index`` overrides ``eval.index`` (``exact``, ``auto`` or a faiss kind for approximate search);
    ``workers`` loader processes decode the images (default: `default_decode_workers`)."""
    loaded = load_embedding_model(str(model), tracking_uri)
    if workers is None:
        workers = default_decode_workers(loaded, batch_size)
    raw = loaded.config.model_dump(mode="json")
    raw["data"] = {**raw["data"], "root": data_root, "prepare": None, "loader_workers": workers}
    # the data set's own Recall@K cut-offs (dataset.json), not the ones of the data the model trained on
    raw["eval"] = {
        **raw["eval"],
        "batch_size": batch_size,
        "max_images": max_images,
        "grid_queries": 0,
        "ks": None,
    }
    if index is not None:
        raw["eval"]["index"] = index
    config = ExperimentConfig.model_validate(raw)
    info = load_dataset_info(data_root)
    return evaluate(
        loaded.net,
        config,
        info,
        loaded.device,
        rank=0,
        world=1,
        logger=None,
        step=0,
        preprocessing=loaded.preprocessing,
    )
