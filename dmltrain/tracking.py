"""MLflow tracking: one MLflow run per dmltrain run, resumed (not duplicated) when the run is relaunched.

Only the driver creates or finds the run (keyed by storage path + run name, the same key Ray Train uses to
resume), and only rank 0 writes to it. Metrics are buffered and written when a checkpoint is reported, so
after a failure the metric history holds exactly the steps whose effect survives in the checkpoint: the
steps Ray replays after a restart are never logged twice.
"""

from __future__ import annotations

import os
import tempfile
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
    set back to RUNNING so the UI shows it as live again.
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
    """Rank 0's handle on the MLflow run: buffered metrics, figures, checkpoints and the final model."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        self.client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self._pending: list[Metric] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue metrics for ``step``; they reach MLflow at the next :meth:`flush`."""
        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), now, step) for k, v in metrics.items())

    def flush(self) -> None:
        """Write queued metrics; called together with a checkpoint (see module docstring)."""
        pending, self._pending = self._pending, []
        for start in range(0, len(pending), _BATCH):
            self.client.log_batch(self.run_id, metrics=pending[start : start + _BATCH])

    def discard_pending(self) -> None:
        self._pending = []

    def logged_steps(self, key: str) -> list[int]:
        """Steps at which ``key`` was logged (used by tests and by resume sanity checks)."""
        return [m.step for m in self.client.get_metric_history(self.run_id, key)]

    def log_figure(self, figure: Figure, artifact_file: str) -> None:
        import matplotlib.pyplot as plt

        self.client.log_figure(self.run_id, figure, artifact_file)
        plt.close(figure)

    def log_text(self, text: str, artifact_file: str) -> None:
        self.client.log_text(self.run_id, text, artifact_file)

    def log_directory(self, local_dir: str | os.PathLike[str], artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_file(self, local_file: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(local_file), artifact_path)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_bytes(self, data: bytes, artifact_file: str) -> None:
        """Store raw bytes (e.g. a state dict) under ``artifact_file``."""
        folder, _, name = artifact_file.rpartition("/")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / name
            path.write_bytes(data)
            self.client.log_artifact(self.run_id, str(path), folder or None)
