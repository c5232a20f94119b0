"""MLflow tracking: one MLflow run per dmltrain run, resumed (not duplicated) when the run is relaunched.

Only the driver creates or finds the run (keyed by storage path + run name, the same key Ray Train uses to
resume), and only rank 0 writes to it. Metrics go out as they are produced, so the MLflow UI is live. After
a restart Ray replays the steps since the last checkpoint (from the same data stream position); the logger
starts from the steps already stored for each metric and skips those, so no step appears twice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RUN_KEY_TAG = "dmltrain.run_key"
_MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
_BATCH = 100  # params or metrics per log_batch call, well under MLflow's limits


def metric_name(key: str) -> str:
    """MLflow forbids ``@`` in metric names: ``eval/test/recall@1`` is logged as ``eval/test/recall_at_1``."""
    return key.replace("@", "_at_")


def resolve_tracking_uri(configured: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else an absolute sqlite store in the working directory.

    The default is made absolute on the driver because Ray workers run in other working directories.
    """
    uri = configured or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def run_key(storage_path: str, name: str) -> str:
    """Identity of a run across relaunches: where Ray keeps its checkpoints."""
    return f"{storage_path.rstrip('/')}/{name}"


def start_or_resume_run(
    tracking_uri: str,
    experiment: str,
    key: str,
    run_name: str,
    params: Mapping[str, str],
    config_yaml: str,
) -> tuple[str, bool]:
    """Find the MLflow run for ``key`` or create it; return ``(run_id, resumed)``.

    A new run gets the flattened config as params and the resolved YAML as an artifact; a resumed run is
    set back to RUNNING so the UI shows it as live again, and gets the relaunch's YAML as another artifact.
    """
    client = MlflowClient(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found else client.create_experiment(experiment)
    existing = client.search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_KEY_TAG}` = '{_quote(key)}'", max_results=1
    )
    if existing:
        run_id = existing[0].info.run_id
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        # Params are immutable in MLflow: keep each relaunch's resolved config beside the original.
        client.log_text(run_id, config_yaml, f"config_relaunch_{time.strftime('%Y%m%dT%H%M%S')}.yaml")
        return run_id, True
    run = client.create_run(experiment_id, run_name=run_name, tags={RUN_KEY_TAG: key})
    run_id = run.info.run_id
    items = [Param(k, v[:_MAX_PARAM_LENGTH]) for k, v in params.items()]
    for start in range(0, len(items), _BATCH):
        client.log_batch(run_id, params=items[start : start + _BATCH])
    client.log_text(run_id, config_yaml, "config.yaml")
    return run_id, False


def _quote(value: str) -> str:
    return value.replace("'", "\\'")


def finish_run(tracking_uri: str, run_id: str, success: bool) -> None:
    client = MlflowClient(tracking_uri)
    client.set_terminated(run_id, status="FINISHED" if success else "FAILED")


class RunLogger:
    """Rank 0's handle on the MLflow run: metrics, figures, checkpoints and the final model."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        # Highest step already stored per metric: replayed steps at or below it are not logged again.
        self._logged_through = {
            key: max(m.step for m in self.client.get_metric_history(run_id, key))
            for key in self.client.get_run(run_id).data.metrics
        }

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log ``metrics`` at ``step`` unless this step of that metric is already stored (a replay)."""
        now = int(time.time() * 1000)
        fresh = []
        for key, value in metrics.items():
            name = metric_name(key)
            if step > self._logged_through.get(name, -1):
                fresh.append(Metric(name, float(value), now, step))
                self._logged_through[name] = step
        for start in range(0, len(fresh), _BATCH):
            self.client.log_batch(self.run_id, metrics=fresh[start : start + _BATCH])

    def history(self, key: str) -> dict[int, float]:
        """``step -> value`` of a metric as stored, across every attempt of a resumed run."""
        return {m.step: m.value for m in self.client.get_metric_history(self.run_id, metric_name(key))}

    def log_figure(self, figure: Figure, artifact_file: str) -> None:
        self.client.log_figure(self.run_id, figure, artifact_file)

    def log_directory(self, local_dir: str | os.PathLike[str], artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_file(self, local_file: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_file), artifact_path)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)
