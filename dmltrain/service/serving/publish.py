"""After a run: log its final and best models to MLflow (pyfunc) from Ray's checkpoints, and register.

The driver does this once training is over, from the checkpoints Ray kept: the latest (the final step; or
where early stopping stopped) becomes artifact ``model``, the best by ``train.best_metric`` becomes
``best_model``. Only weights travel (no optimizer state), so MLflow holds two models per run instead of a
copy of every checkpoint.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dmltrain.service.best import SCORE_KEY, is_scored
from dmltrain.service.builders import resolve_preprocessing
from dmltrain.service.checkpoints import checkpoint_dir_step, checkpoint_stored, checkpoint_uri, load_state
from dmltrain.service.config import ExperimentConfig
from dmltrain.service.mlflow_scope import tracking_uri
from dmltrain.service.serving.pyfunc import STEP_PARAM, log_embedding_model
from dmltrain.service.serving.weights import WEIGHTS_FILE, save_weights
from dmltrain.service.tracking import CHECKPOINT_STEP_TAG

log = logging.getLogger("dmltrain.service.serving.publish")

FINAL_MODEL = "model"
BEST_MODEL = "best_model"
SUPERSEDED_TAG = "dmltrain.superseded_by"  # on a model a later launch of its run replaced


@dataclass(frozen=True)
class Published:
    """What was logged: artifact name -> (model URI, training step), and the registered version if any."""

    models: dict[str, tuple[str, int]]
    registered: str | None = None


def _already_logged(tracking: str, run_id: str, name: str, step: int) -> str | None:
    """The URI of a READY model ``name`` that this run already logged from step ``step``, if any.

    A relaunch of a run whose driver died while publishing (SIGKILL, a lost head node) trains no further
    step and publishes again: without this it would log every model a second time, and register the
    final one as a new version. Models such a death left PENDING (their upload cut short) are deleted, so
    neither the UI nor ``runs:/<run_id>/<name>`` offers a half-written model."""
    import mlflow
    from mlflow.entities import LoggedModelStatus

    client = mlflow.MlflowClient(tracking)
    ready = None
    for model in _run_models(client, run_id, name):
        if model.status == LoggedModelStatus.PENDING:
            client.delete_logged_model(model.model_id)
            log.info("deleted %s (%s): left unfinished by an earlier publish", name, model.model_id)
        elif model.status == LoggedModelStatus.READY and model.params.get(STEP_PARAM) == str(step):
            ready = ready or model.model_uri
    return ready


def _run_models(client: Any, run_id: str, name: str) -> list[Any]:
    """The logged models ``name`` of run ``run_id``, whatever their status."""
    experiment = client.get_run(run_id).info.experiment_id
    return client.search_logged_models(
        experiment_ids=[experiment], filter_string=f"source_run_id = '{run_id}' AND name = '{name}'"
    )


def _log_checkpoint(
    checkpoint: Any, config: ExperimentConfig, tracking: str, run_id: str, name: str, tags: dict[str, str]
) -> tuple[str, int, dict[str, Any] | None]:
    """Log ``checkpoint``'s weights as model ``name`` (unless logged before); returns its URI, its step
    and the best-evaluation tracker's state it carries."""
    with checkpoint.as_directory() as directory, tempfile.TemporaryDirectory() as tmp:
        state = load_state(directory)
        tracked = state.extra.get("best")
        logged = _already_logged(tracking, run_id, name, state.step)
        if logged is not None:
            log.info("%s (step %d) was logged before, as %s: kept", name, state.step, logged)
            return logged, state.step, tracked
        weights = save_weights(
            Path(tmp) / WEIGHTS_FILE,
            state.model,
            config.model_dump(mode="json"),
            state.step,
            resolve_preprocessing(config).to_dict(),  # the backbone's own, with the run's data.* overrides
        )
        info = log_embedding_model(tracking, run_id, name, weights, step=state.step, tags=tags)
    log.info("logged %s (step %d) as runs:/%s/%s", name, state.step, run_id, name)
    _mark_superseded(tracking, run_id, name, info.model_id, state.step)
    return info.model_uri, state.step, tracked


def _mark_superseded(tracking: str, run_id: str, name: str, newest: str, step: int) -> None:
    """Tag this run's earlier models ``name`` (a launch before a relaunch that trained further) with the
    one that replaces them: the UI listed two `model` and two `best_model` entries, the older `best_model`
    still carrying its score. They stay (a registered version may point at one)."""
    import mlflow

    client = mlflow.MlflowClient(tracking)
    for model in _run_models(client, run_id, name):
        if model.model_id != newest and SUPERSEDED_TAG not in model.tags:
            client.set_logged_model_tags(model.model_id, {SUPERSEDED_TAG: f"{newest} (step {step})"})


def best_checkpoint(result: Any, config: ExperimentConfig) -> tuple[Any, float] | None:
    """Ray's best kept checkpoint by ``checkpoint_score``, if any evaluated checkpoint exists."""
    if not config.train.best_metric or not result.best_checkpoints:
        return None
    scored = [(c, float(m[SCORE_KEY])) for c, m in result.best_checkpoints if is_scored(m.get(SCORE_KEY))]
    if not scored:
        return None
    pick = max if config.train.best_mode == "max" else min
    return pick(scored, key=lambda item: item[1])


def tracked_best(
    ranked: tuple[Any, float] | None, tracked: dict[str, Any] | None, config: ExperimentConfig
) -> tuple[Any, float] | None:
    """The best checkpoint as the run's own tracker saw it (``tracked``: its state in the final
    checkpoint), where Ray's list (``ranked``) does not hold it: a checkpoint stored while the driver died
    was never registered with Ray, and `best_checkpoint` then published the best of the rest (step 20 at
    Recall@1 0.02 over step 10 at 0.83). Ray's pick otherwise."""
    if not config.train.best_metric or not tracked or tracked.get("score") is None:
        return ranked
    if int(tracked.get("step", -1)) < 0:
        return ranked
    step = int(tracked["step"])
    if ranked is not None and checkpoint_dir_step(str(ranked[0].path)) == step:
        return ranked
    uri = checkpoint_uri(config.run.storage_path, config.run.name, step)
    if not checkpoint_stored(uri):  # deleted by Ray's keep-N since (it ranked it lower): keep Ray's pick
        return ranked
    import ray.train

    log.info("best model from the step-%d checkpoint the run's tracker chose (%s)", step, uri)
    return ray.train.Checkpoint(uri), float(tracked["score"])


def final_checkpoint(result: Any, config: ExperimentConfig, tracking: str, run_id: str) -> Any:
    """The run's newest checkpoint: Ray's, or the newer one rank 0 tagged in MLflow as complete in storage
    (a node or driver that died between storing it and Ray registering it; the relaunch restored it, as
    the worker loop does, and trained nothing further, so Ray's result still names the older one)."""
    import mlflow
    import ray.train

    tagged = mlflow.MlflowClient(tracking).get_run(run_id).data.tags.get(CHECKPOINT_STEP_TAG, "")
    registered = checkpoint_dir_step(str(result.checkpoint.path)) if result.checkpoint is not None else None
    if not tagged.isdigit() or (result.checkpoint is not None and (registered or 0) >= int(tagged)):
        return result.checkpoint
    uri = checkpoint_uri(config.run.storage_path, config.run.name, int(tagged))
    log.info(
        "final model from the step-%s checkpoint rank 0 stored (%s); Ray registered %s",
        tagged,
        uri,
        registered,
    )
    return ray.train.Checkpoint(uri)


def publish_run_models(
    result: Any, config: ExperimentConfig, tracking: str, run_id: str, best_metric: str | None = None
) -> Published:
    """Log the final and best models of a finished Ray Train ``result``; register if mlflow.register_as.
    ``best_metric``: the metric ``train.best_metric`` resolved to (``auto`` names none), for the tag."""
    models: dict[str, tuple[str, int]] = {}
    final = final_checkpoint(result, config, tracking, run_id)
    tracked = None
    if final is not None:
        uri, step, tracked = _log_checkpoint(final, config, tracking, run_id, FINAL_MODEL, {})
        models[FINAL_MODEL] = (uri, step)
    best = tracked_best(best_checkpoint(result, config), tracked, config)
    if best is not None:
        checkpoint, score = best
        metric = best_metric or str(config.train.best_metric)
        tags = {"dmltrain.best_metric": metric, "dmltrain.best_score": f"{score:.6g}"}
        uri, step, _ = _log_checkpoint(checkpoint, config, tracking, run_id, BEST_MODEL, tags)
        models[BEST_MODEL] = (uri, step)
    registered = None
    if config.mlflow.register_as and FINAL_MODEL in models:
        name, model_uri = config.mlflow.register_as, models[FINAL_MODEL][0]
        registered = registered_version(tracking, run_id, name, model_uri) or register(
            tracking, run_id, name, model_uri=model_uri
        )
    return Published(models, registered)


def registered_version(tracking: str, run_id: str, name: str, model_uri: str) -> str | None:
    """The models:/ URI of a version of ``name`` that already holds ``model_uri`` (logged by ``run_id``):
    a relaunch that publishes again registers nothing new."""
    import mlflow

    client = mlflow.MlflowClient(tracking)
    for version in client.search_model_versions(f"name = '{name}' AND run_id = '{run_id}'"):
        if version.source == model_uri:
            log.info("%s is already version %s of %s: kept", model_uri, version.version, name)
            return f"models:/{name}/{version.version}"
    return None


def register(
    tracking: str, run_id: str, name: str, artifact: str = FINAL_MODEL, model_uri: str | None = None
) -> str:
    """Register ``runs:/<run_id>/<artifact>`` as a new version of ``name``; returns its models:/ URI.
    ``model_uri``: the logged model's own URI (``models:/m-...``, from logging it), which MLflow 3 would
    otherwise look up from the runs:/ form with a warning that reads like a fault."""
    import mlflow

    with tracking_uri(tracking):
        version = mlflow.register_model(model_uri or f"runs:/{run_id}/{artifact}", name)
    log.info("registered runs:/%s/%s as models:/%s/%s", run_id, artifact, name, version.version)
    return f"models:/{name}/{version.version}"
