"""``python -m dmltrain.run CONFIG [key.sub=value ...]``: validate, prepare, and run one experiment on Ray.

The driver does everything that must happen once and before any worker starts: it validates the config
(a typo fails here, before Ray is contacted), resolves relative paths against the launch directory (Ray
workers run elsewhere), builds the embedded data set on first use, finds or creates the MLflow run, and
then hands the loop to ``ray.train.torch.TorchTrainer``. Relaunching the same config resumes both the Ray
run (same ``run.name`` and ``run.storage_path``) and the MLflow run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dmltrain.service.config import ConfigError, ExperimentConfig, flatten, load_config, to_yaml

log = logging.getLogger("dmltrain.service.run")

# Loopback-only, no telemetry: sensible on a laptop and harmless on a cluster (setdefault keeps user values).
_RAY_ENV_DEFAULTS = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0"}


@dataclass(frozen=True)
class RunOutcome:
    """What a finished launch reports back to the caller (CLI, tests)."""

    mlflow_run_id: str
    tracking_uri: str
    resumed: bool
    checkpoint_path: str | None
    metrics: dict[str, float]


def resolve_paths(config: ExperimentConfig, base: Path | None = None) -> ExperimentConfig:
    """Make local relative paths absolute against the launch directory; URLs are left untouched."""
    from dmltrain.data.urls import is_local, local_path

    base = base or Path.cwd()
    updates: dict[str, dict[str, str]] = {}
    for section, key, value in (
        ("data", "root", config.data.root),
        ("run", "storage_path", config.run.storage_path),
    ):
        if is_local(value) and not Path(local_path(value)).is_absolute():
            updates[section] = {key: str((base / local_path(value)).resolve())}
    weights = config.model.weights
    if weights and (base / weights).is_file() and not Path(weights).is_absolute():
        updates["model"] = {"weights": str((base / weights).resolve())}
    if not updates:
        return config
    data = config.model_dump()
    for section, values in updates.items():
        data[section].update(values)
    return ExperimentConfig.model_validate(data)


def prepare_data(config: ExperimentConfig) -> None:
    """Build the embedded data set if asked, then check the shards' metadata before any worker starts."""
    from dmltrain.data import ensure_glyphs, load_dataset_info

    if config.data.prepare == "glyphs":
        ensure_glyphs(config.data.root)
    info = load_dataset_info(config.data.root)
    if config.data.train_split not in info.splits:
        raise ConfigError(
            f"data.train_split: split {config.data.train_split!r} is not in {config.data.root}/dataset.json "
            f"(it has {sorted(info.splits)})"
        )
    if not info.evaluations:
        raise ConfigError(f"{config.data.root}/dataset.json lists no evaluations to run")


def batchnorm_note(config: ExperimentConfig) -> str | None:
    """One line for the start of a run whose BatchNorm breaks the exact global-batch gradient, else None.

    With ``model.freeze_bn: false`` training-mode BatchNorm normalises each forward chunk with that chunk's
    statistics; that is the global batch's only when it is embedded in one chunk on one worker.
    """
    chunk = min(config.train.chunk_size, config.local_batch_size)
    if config.model.freeze_bn or (config.scaling.num_workers == 1 and chunk == config.local_batch_size):
        return None
    return (
        f"model.freeze_bn=false: BatchNorm normalises chunks of <= {chunk} images on each of "
        f"{config.scaling.num_workers} worker(s) with their own statistics, so a step is not the exact "
        f"gradient of the global batch of {config.train.global_batch_size} (it depends on "
        "train.chunk_size and scaling.num_workers); set model.freeze_bn=true for the exact global-batch step"
    )


def _connect_ray() -> None:
    import ray

    for key, value in _RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    if not ray.is_initialized():
        # Joins the cluster in RAY_ADDRESS (or the one `ray job submit` runs in); else starts a local one.
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)


def _wants_gpu(config: ExperimentConfig) -> bool:
    import ray

    if config.scaling.use_gpu == "auto":
        return ray.cluster_resources().get("GPU", 0) >= 1
    return bool(config.scaling.use_gpu)


def launch(config: ExperimentConfig) -> RunOutcome:
    """Run (or resume) one experiment to completion on the Ray cluster; returns the outcome."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from dmltrain.service.tracking import finish_run, resolve_tracking_uri, run_key, start_or_resume_run
    from dmltrain.service.train import train_loop_per_worker

    config = resolve_paths(config)
    prepare_data(config)
    note = batchnorm_note(config)
    if note:
        log.warning(note)
    tracking_uri = resolve_tracking_uri(config.mlflow.tracking_uri)
    run_id, resumed = start_or_resume_run(
        tracking_uri,
        config.mlflow.experiment,
        run_key(config.run.storage_path, config.run.name),
        config.run.name,
        flatten(config),
        to_yaml(config),
    )
    log.info("MLflow run %s (%s) at %s", run_id, "resumed" if resumed else "new", tracking_uri)
    _connect_ray()
    use_gpu = _wants_gpu(config)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": config.model_dump(mode="json"),
            "mlflow_run_id": run_id,
            "tracking_uri": tracking_uri,
        },
        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=config.scaling.num_workers,
            use_gpu=use_gpu,
            resources_per_worker={"CPU": config.scaling.cpus_per_worker, **({"GPU": 1} if use_gpu else {})},
        ),
        run_config=RunConfig(
            name=config.run.name,
            storage_path=config.run.storage_path,
            checkpoint_config=CheckpointConfig(num_to_keep=config.run.keep_checkpoints),
            failure_config=FailureConfig(max_failures=config.run.max_failures),
        ),
    )
    try:
        result = trainer.fit()
    except BaseException:
        finish_run(tracking_uri, run_id, success=False)
        raise
    finish_run(tracking_uri, run_id, success=result.error is None)
    if result.error is not None:
        raise result.error
    metrics = {k: float(v) for k, v in (result.metrics or {}).items() if isinstance(v, int | float)}
    checkpoint = result.checkpoint.path if result.checkpoint else None
    return RunOutcome(run_id, tracking_uri, resumed, checkpoint, metrics)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dmltrain.run",
        description="Train an embedding network with a ranking loss on Ray Train, tracked in MLflow.",
    )
    parser.add_argument("config", help="experiment YAML, e.g. configs/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as train.steps=100 optim.lr=1e-4")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        outcome = launch(load_config(args.config, args.overrides))
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = ", ".join(f"{k}={v:.4f}" for k, v in sorted(outcome.metrics.items()) if k.startswith("eval/"))
    print(f"run finished: MLflow run {outcome.mlflow_run_id} in {outcome.tracking_uri}; {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
