"""Best checkpoint, early stopping, the run's MLflow models and registration, end to end on a local Ray
cluster (real MLflow sqlite store, real glyph shards).

min_delta is set beyond any possible improvement, so the first evaluation is the best and the second
stops the run: a deterministic early stop whose best and final models are different checkpoints.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from dmltrain.service.checkpoints import checkpoint_dir_name, checkpoint_dir_step
from dmltrain.service.config import load_config
from dmltrain.service.run import launch
from dmltrain.service.serving.loading import load_embedding_model
from dmltrain.service.serving.publish import publish_run_models

pytestmark = pytest.mark.service

REPO = Path(__file__).parents[1]


def test_best_checkpoint_early_stop_models_and_registry(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"data.root={glyphs_root}",
            "data.prepare=null",
            "run.name=best",
            f"run.storage_path={tmp_path / 'ray_results'}",
            "run.keep_checkpoints=1",
            f"mlflow.tracking_uri={uri}",
            # The layout this scenario was written for: its step-4 evaluation scores below step 2's, so
            # Ray keeps both (best by score, and latest). The quickstart's 1 x 2 draws other batches.
            "scaling.num_workers=2",
            "scaling.cpus_per_worker=1",
            "scaling.torch_threads=1",
            "data.loader_workers=0",
            "mlflow.register_as=quickstart-glyphs",
            "train.steps=12",
            "train.global_batch_size=32",
            "train.chunk_size=16",
            "train.eval_every=2",
            "train.checkpoint_every=1",
            "train.log_every=1",
            "train.eval_at_start=false",
            "train.best_metric=eval/test/map@r",
            "train.early_stopping_patience=1",
            "train.early_stopping_min_delta=1.0",
            "eval.max_images=400",
            "eval.grid_queries=0",
        ],
    )
    outcome = launch(config)
    client = MlflowClient(uri)
    run = client.get_run(outcome.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert (
        run.data.tags["dmltrain.early_stopped_at_step"] == "4" and run.data.tags["dmltrain.best_step"] == "2"
    )
    assert max(m.step for m in client.get_metric_history(outcome.mlflow_run_id, "train/loss")) == 4
    # Ray kept the best (step 2) and the latest (step 4); the others were deleted as they aged, except that
    # Ray never deletes a checkpoint whose report it is still handling when a newer one arrives (seen once
    # on a loaded machine: three checkpoints kept).
    kept = {checkpoint_dir_step(str(p)) for p in (tmp_path / "ray_results" / "best").glob("checkpoint_*")}
    assert {2, 4} <= kept and len(kept) <= 3, kept  # of 4 checkpoints (steps 1-4), one or two deleted
    # No optimizer state went to MLflow by default: the run holds models, not checkpoints.
    assert not [a for a in client.list_artifacts(outcome.mlflow_run_id) if a.path == "checkpoints"]
    final = load_embedding_model(f"runs:/{outcome.mlflow_run_id}/model", uri)
    best = load_embedding_model(f"runs:/{outcome.mlflow_run_id}/best_model", uri)
    assert (final.step, best.step) == (4, 2)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(final.net.state_dict().values(), best.net.state_dict().values(), strict=True)
    )
    assert outcome.registered == "models:/quickstart-glyphs/1"
    version = client.get_model_version("quickstart-glyphs", "1")
    assert version.run_id == outcome.mlflow_run_id
    registered = load_embedding_model("models:/quickstart-glyphs/1", uri)
    assert registered.step == 4

    # A relaunch after a driver died while publishing publishes again, from the same checkpoints: the
    # models logged before are kept (not logged twice), a model the death left PENDING is deleted, and
    # no second version is registered.
    from ray.train import Result

    experiment = run.info.experiment_id
    query = f"source_run_id = '{outcome.mlflow_run_id}'"
    before = {m.model_id for m in client.search_logged_models([experiment], filter_string=query)}
    assert len(before) == 2
    cut_short = client.create_logged_model(experiment, name="best_model", source_run_id=outcome.mlflow_run_id)
    relaunched = Result.from_path(tmp_path / "ray_results" / "best")  # the checkpoints a relaunch finds
    again = publish_run_models(relaunched, config, uri, outcome.mlflow_run_id)
    assert {name: uri for name, (uri, _step) in again.models.items()} == outcome.models
    assert again.registered == outcome.registered
    after = client.search_logged_models([experiment], filter_string=query)
    assert {m.model_id for m in after} == before  # the PENDING one is gone
    assert [str(v.version) for v in client.search_model_versions("name = 'quickstart-glyphs'")] == ["1"]
    assert cut_short.model_id not in {m.model_id for m in after}

    # Ray's result names an older checkpoint than the one rank 0 stored and tagged (a node died before
    # Ray registered it; the relaunch restored the tagged one and trained nothing): the final model is
    # the tagged one, not Ray's.
    from types import SimpleNamespace

    from ray.train import Checkpoint

    older = Checkpoint(str(tmp_path / "ray_results" / "best" / checkpoint_dir_name(2)))
    stale = SimpleNamespace(checkpoint=older, best_checkpoints=[])
    final_model = publish_run_models(stale, config, uri, outcome.mlflow_run_id).models["model"]
    assert final_model == (outcome.models["model"], 4)

    # Ray's list without the run's best (a checkpoint stored while the driver died is never registered
    # with Ray): best_model was the best of the rest. The run's own tracker (in the final checkpoint)
    # names step 2, whose checkpoint is still in storage: that one is the best model.
    from dmltrain.service.best import SCORE_KEY
    from dmltrain.service.checkpoints import load_state, save_state
    from dmltrain.service.serving.publish import SUPERSEDED_TAG
    from dmltrain.service.serving.pyfunc import STEP_PARAM

    step4 = Checkpoint(str(older.path).replace(checkpoint_dir_name(2), checkpoint_dir_name(4)))
    unregistered = SimpleNamespace(checkpoint=step4, best_checkpoints=[(step4, {SCORE_KEY: 0.5})])
    best_again = publish_run_models(unregistered, config, uri, outcome.mlflow_run_id).models["best_model"]
    assert best_again == (outcome.models["best_model"], 2)

    # A later launch that publishes a newer best_model (the step-4 checkpoint scored best, for Ray and the
    # tracker) tags the one it replaces: the run listed two best_model entries, the older still carrying
    # its score, and nothing told them apart. The best_model names the metric it was chosen by.
    rescored = tmp_path / "rescored" / checkpoint_dir_name(4)
    shutil.copytree(step4.path, rescored)
    state = load_state(rescored)
    state.extra["best"] = {**state.extra["best"], "score": 1.0, "step": 4}
    save_state(rescored, state)
    newer = SimpleNamespace(
        checkpoint=Checkpoint(str(rescored)), best_checkpoints=[(Checkpoint(str(rescored)), {SCORE_KEY: 1.0})]
    )
    publish_run_models(newer, config, uri, outcome.mlflow_run_id, "eval/test/map@r")
    bests = client.search_logged_models([experiment], filter_string=f"{query} AND name = 'best_model'")
    tags = {m.params[STEP_PARAM]: m.tags for m in bests}
    assert sorted(tags) == ["2", "4"] and SUPERSEDED_TAG not in tags["4"]
    newest = next(m.model_id for m in bests if m.params[STEP_PARAM] == "4")
    assert tags["2"][SUPERSEDED_TAG] == f"{newest} (step 4)"
    assert tags["4"]["dmltrain.best_metric"] == "eval/test/map@r"
