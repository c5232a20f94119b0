"""What a launch does when ``run.name`` (in ``run.storage_path``) already exists: ``run.resume``.

A run is one model trained with one recipe. Relaunching it may change how long it trains and how often it
logs, evaluates and checkpoints (:data:`RESUMABLE_KEYS`); any other change (learning rate, loss, data,
model, batch...) would silently continue the old model with a new recipe and report a mix of both, so:

- ``auto`` (default): start the run if it does not exist; resume it if only resumable keys changed; refuse
  with the differences otherwise. A finished run whose last checkpoint already reached ``train.steps`` is
  left as it is (nothing to train).
- ``must``: resume whatever changed (the change is recorded in MLflow as a new segment); refuse if there is
  nothing to resume.
- ``never``: always a new run; refuse if the name exists (so an old run is never overwritten or silently
  continued: pick a new ``run.name``).

Ray Train resumes from the newest checkpoint in ``<storage_path>/<name>`` on its own; this module decides
whether the driver lets it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from dmltrain.service.config import ConfigError, ExperimentConfig, flatten, flatten_mapping
from dmltrain.service.tracking import HEARTBEAT_STALE_SECONDS, ExistingRun, redact_credentials

# Keys a resumed run may change: length, cadence, fault tolerance and pure execution settings that leave the
# trained model unchanged (chunk_size: the engine computes the same global-batch gradient whatever it is,
# with frozen BatchNorm (`_resumable`);
# data.decode, data.host_decode_share: the same samples, crops and flips, only the JPEG decoder differs;
# data.cache_mb: the same batches).
RESUMABLE_KEYS = frozenset(
    {
        "train.steps",
        "train.log_every",
        "train.checkpoint_every",
        "train.eval_every",
        "train.eval_at_start",
        "train.max_skipped_steps",
        "train.chunk_size",
        "train.profile_start",
        "train.profile_steps",
        "eval.ks",  # only what is reported (an unset one is now the data set's own)
        "eval.batch_size",
        "eval.grid_queries",
        "eval.cache_mb",
        "run.max_failures",
        "run.keep_checkpoints",
        "run.resume",
        "scaling.torch_threads",
        "scaling.omp_wait_policy",
        "scaling.keep_freed_memory",
        "scaling.ray_priority",
        "scaling.topology",
        "scaling.worker_niceness",
        "scaling.cpus_per_worker",
        "data.loader_priority",
        "run.checkpoint_upload",
        "mlflow.register_as",
        "data.prepare",
        "data.decode",
        "data.host_decode_share",
        "data.cache_mb",
        "mlflow.tracking_uri",
        "mlflow.log_checkpoints",
    }
)

Action = Literal["new", "resume", "done"]


@dataclass(frozen=True)
class LaunchPlan:
    action: Action
    changed: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)
    message: str = ""


def config_changes(old: dict[str, Any], new: ExperimentConfig) -> dict[str, tuple[str | None, str | None]]:
    """Flattened ``key -> (old, new)`` for every setting that differs; ``old`` is a stored config dict."""
    try:
        before = flatten(ExperimentConfig.model_validate(old))
    except ValidationError as error:
        # A config this version no longer accepts: compare what is there, key by key.
        before = flatten_mapping(old)
        before.setdefault("<stored config>", f"invalid now ({error.error_count()} errors)")
    after = flatten(new)
    # Compared as recorded: the stored config has passwords in URIs masked (a data.root with one was a
    # change on every relaunch, and refused under auto).
    before = {k: redact_credentials(v) for k, v in before.items()}
    after = {k: redact_credentials(v) for k, v in after.items()}
    keys = sorted(set(before) | set(after))
    return {k: (before.get(k), after.get(k)) for k in keys if before.get(k) != after.get(k)}


def _describe(changes: dict[str, tuple[str | None, str | None]]) -> str:
    return ", ".join(f"{k}: {old} -> {new}" for k, (old, new) in changes.items())


def _resumable(key: str, config: ExperimentConfig) -> bool:
    """Whether ``run.resume=auto`` may continue a run across a change of ``key``. Chunks are exact only with
    frozen BatchNorm: live BatchNorm normalises each chunk with its own statistics, so the chunk size is
    part of the recipe there."""
    if key == "train.chunk_size":
        return config.model.freeze_bn
    return key in RESUMABLE_KEYS


DATA_CHANGE = "<data: dataset.json fingerprint>"  # a change no config key shows: the data was re-prepared


def plan_launch(
    config: ExperimentConfig,
    existing: ExistingRun | None,
    checkpoints: int | None,
    tracking_uri: str,
    data_fingerprint: str | None = None,
    now: float | None = None,
) -> LaunchPlan:
    """Decide from ``run.resume``, the run's MLflow record and the number of Ray checkpoints on storage
    (None: storage could not be listed, so only MLflow's record counts). ``data_fingerprint``: the
    fingerprint in the ``dataset.json`` this launch would train on. Data prepared again with other options
    (another test split, resize, seed) under the same ``data.root`` changes it, and is a change like any
    other setting: continuing would train on former test classes and mix two test sets in one run. A run
    whose driver is alive (a fresh heartbeat: ``DriverHeartbeat``; ``now`` defaults to the clock) is refused
    whatever ``run.resume`` says.

    Raises ConfigError (one line, naming ``run.resume`` / ``run.name`` and what to do) when refused.
    """
    mode = config.run.resume
    name = f"run.name={config.run.name} in run.storage_path={config.run.storage_path}"
    if existing is None and not checkpoints:
        if mode == "must":
            raise ConfigError(
                f"run.resume=must: {name} has no checkpoint and no MLflow run in {tracking_uri} to resume; "
                f"check run.name, run.storage_path and the tracking URI, or set run.resume=auto to start it"
            )
        return LaunchPlan("new")
    where = (
        f"MLflow run {existing.run_id} ({existing.status}, "
        + (
            f"last checkpoint at step {existing.checkpoint_step})"
            if existing.checkpoint_step is not None
            else "no checkpoint yet)"
        )
        if existing is not None
        else f"{checkpoints} Ray checkpoint(s) but no MLflow run in {tracking_uri}"
    )
    if existing is not None and existing.status == "RUNNING" and existing.heartbeat is not None:
        age = (time.time() if now is None else now) - existing.heartbeat[0]
        if age < HEARTBEAT_STALE_SECONDS:
            raise ConfigError(
                f"run.name={config.run.name} is being trained by another driver ({existing.heartbeat[1]}, "
                f"alive {max(age, 0):.0f} s ago, MLflow run {existing.run_id}): wait for it or stop it (ray "
                f"job stop), or set a new run.name; a driver that was killed outright counts as gone "
                f"{HEARTBEAT_STALE_SECONDS:.0f} s after its last sign of life"
            )
    if mode == "never":
        raise ConfigError(
            f"run.resume=never: {name} already exists ({where}); set a new run.name to start a new run, "
            f"or run.resume=auto to continue this one"
        )
    if existing is None:
        if mode == "auto":
            raise ConfigError(
                f"run.resume=auto: {name} has {checkpoints} Ray checkpoint(s) but no MLflow run in "
                f"{tracking_uri} (another tracking URI or experiment?); set run.resume=must to continue it "
                f"into a new MLflow run, or a new run.name to start afresh"
            )
        return LaunchPlan("resume", message=f"resuming {name} from its Ray checkpoints into a new MLflow run")
    if checkpoints == 0 and existing.checkpoint_step:
        raise ConfigError(
            f"run.resume={mode}: {where}, but run.storage_path={config.run.storage_path} holds no "
            f"checkpoint of run.name={config.run.name} (moved or deleted?); point run.storage_path at "
            f"them, or set a new run.name to start afresh"
        )
    if existing.config is not None:
        changed = config_changes(existing.config, config)
    else:
        changed = {"<stored config>": ("unreadable", None)}
    known = existing.data_fingerprint
    if known and data_fingerprint and known != data_fingerprint:
        changed[DATA_CHANGE] = (known[:12], data_fingerprint[:12])  # sha256 hex: 12 digits tell them apart
    blocking = {k: v for k, v in changed.items() if not _resumable(k, config)}
    if blocking and mode == "auto":
        raise ConfigError(
            f"run.resume=auto: {name} exists ({where}) and this launch changes {_describe(blocking)}; "
            f"set a new run.name to start a new run with these settings, or run.resume=must to continue "
            f"this run with them (recorded in MLflow as a new segment)"
        )
    step = existing.checkpoint_step or 0
    stopping = {k for k in changed if k.startswith(("train.early_stopping_", "train.best_"))}
    # the tag stays when a later launch trained on; only a run that ended where it stopped is stopped
    stopped = existing.early_stopped_at is not None and existing.early_stopped_at == existing.checkpoint_step
    if existing.status == "FINISHED" and stopped and not stopping:
        return LaunchPlan(
            "done",
            changed,
            f"{name} stopped early at step {existing.early_stopped_at} (train.early_stopping_patience="
            f"{config.train.early_stopping_patience}): nothing to train; relaunch with run.resume=must and "
            f"another train.early_stopping_patience to train further, or set a new run.name for a new run",
        )
    if existing.status == "FINISHED" and step >= config.train.steps:
        return LaunchPlan(
            "done",
            changed,
            f"{name} already finished at step {step} (train.steps={config.train.steps}): nothing to train; "
            f"raise train.steps to train further, or set a new run.name for a new run",
        )
    if step > config.train.steps:  # it would train nothing, skip the last evaluation, and end FINISHED
        raise ConfigError(
            f"run.resume={mode}: {name} has a checkpoint at step {step} ({where}), past train.steps="
            f"{config.train.steps}: resuming would train nothing and publish the step-{step} model as this "
            f"run's; set train.steps to {step} or more, or a new run.name to start afresh"
        )
    return LaunchPlan("resume", changed, f"resuming {name} at step {step} ({where})")
