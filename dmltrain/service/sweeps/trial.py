"""The Ray Tune trainable of a sweep: one trial = one experiment through the service's own driver.

Ray Train V2 runs inside Tune as a function trainable that calls ``TorchTrainer.fit()`` (Ray's
"Hyperparameter Tuning with Ray Tune" guide for Train V2); here that call is
:func:`dmltrain.service.run.launch`, so a trial gets exactly what ``python -m dmltrain.run`` does: the
driver's checks, the resume policy, the MLflow run (a child of the sweep's parent run), checkpoints,
evaluations and the published models. Ray Train's reports reach Tune live through ``TuneReportCallback``;
the finished run's metrics are reported once more with its MLflow run id.
"""

from __future__ import annotations

from typing import Any

from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

SWEEP_TAG = "dmltrain.sweep"  # the sweep's name, on the parent and every child run
SWEEP_KEY_TAG = "dmltrain.sweep_key"  # storage path + sweep name: identifies the parent across relaunches
TRIAL_TAG = "dmltrain.sweep_trial"  # the trial's label, on child runs
BASELINE_TAG = "dmltrain.sweep_baseline"  # on baseline child runs (no training)


def child_tags(parent_run_id: str, sweep: str, label: str) -> dict[str, str]:
    """Tags that make an MLflow run a nested child of the sweep's parent run."""
    return {MLFLOW_PARENT_RUN_ID: parent_run_id, SWEEP_TAG: sweep, TRIAL_TAG: label}


def run_trial(params: dict[str, Any], payloads: dict[str, dict[str, Any]]) -> None:
    """Tune function trainable. ``params["trial"]`` is the trial's label (Tune's grid); ``payloads[label]``
    holds its resolved experiment config and the parent run (built by :mod:`dmltrain.service.sweeps.driver`
    and passed once through ``tune.with_parameters``)."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from dmltrain.service.config import ExperimentConfig
    from dmltrain.service.run import launch

    trial = payloads[params["trial"]]
    config = ExperimentConfig.model_validate(trial["config"])
    if config.scaling.ray_priority == "auto":
        # Trials start while others train on the same cores: Ray's bookkeeping processes under SCHED_IDLE
        # would get next to no CPU for the next trial's start. auto keeps Ray's own priority in sweeps.
        scaling = config.scaling.model_copy(update={"ray_priority": "normal"})
        config = config.model_copy(update={"scaling": scaling})
    outcome = launch(
        config,
        tags=child_tags(trial["parent_run_id"], trial["sweep"], trial["label"]),
        callbacks=[TuneReportCallback()],
    )
    numbers = {k: v for k, v in outcome.metrics.items() if isinstance(v, int | float)}
    ray.tune.report({**numbers, "mlflow_run_id": outcome.mlflow_run_id, "resumed": outcome.resumed})
