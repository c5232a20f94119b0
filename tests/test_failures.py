"""Only real faults are retried: a deterministic worker error ends a Ray Train run on its first attempt.

Real Ray Train runs on the session cluster: one attempt for a FatalRunError despite max_failures=3, every
retry for an ordinary error, and the real worker loop classifying a data-layout error as fatal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dmltrain.service.errors import FatalRunError, as_fatal, fatal_cause

pytestmark = pytest.mark.service


def _attempt(config: dict) -> None:
    """Counts its attempts in a file, then fails as configured."""
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        with open(config["log"], "a") as handle:
            handle.write("attempt\n")
    error = FileNotFoundError("model.weights: file not found: /nowhere.pt")
    if config["fatal"]:
        raise as_fatal(error, ray.train.get_context().get_world_rank(), "setup") from error
    raise RuntimeError("a peer went away")  # what a lost node looks like to the survivors


def _fit(tmp_path: Path, name: str, fatal: bool, max_failures: int) -> tuple[BaseException, int]:
    import ray.cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from dmltrain.service.callbacks import StopOnFatalError

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules
    log = tmp_path / f"{name}.log"
    trainer = TorchTrainer(
        _attempt,
        train_loop_config={"log": str(log), "fatal": fatal},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(
            name=name,
            storage_path=str(tmp_path / "ray"),
            failure_config=FailureConfig(max_failures=max_failures),
            callbacks=[StopOnFatalError()],
        ),
    )
    with pytest.raises(Exception) as caught:
        trainer.fit()
    return caught.value, log.read_text().count("attempt")


def test_fatal_errors_are_not_retried_but_faults_are(ray_cluster, tmp_path: Path) -> None:
    error, attempts = _fit(tmp_path, "fatal", fatal=True, max_failures=3)
    assert attempts == 1
    fatal = fatal_cause(error)
    assert isinstance(fatal, FatalRunError)
    assert str(fatal) == "rank 0 setup: FileNotFoundError: model.weights: file not found: /nowhere.pt"

    error, attempts = _fit(tmp_path, "fault", fatal=False, max_failures=1)
    assert attempts == 2 and fatal_cause(error) is None  # the first try and one retry


def test_the_worker_loop_calls_a_data_layout_error_fatal(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    """train_loop_per_worker itself, with data the driver would have refused (its checks are skipped here)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from dmltrain.service.callbacks import StopOnFatalError
    from dmltrain.service.config import load_config
    from dmltrain.service.train import train_loop_per_worker

    config = load_config(
        Path(__file__).parents[1] / "configs" / "quickstart.yaml",
        [
            f"data.root={tmp_path / 'no_shards'}",
            "data.prepare=null",
            "scaling.num_workers=1",
            "train.steps=1",
        ],
    )
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "config": config.model_dump(mode="json"),
            "mlflow_run_id": "unused",
            "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        },
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False),
        run_config=RunConfig(
            name="layout",
            storage_path=str(tmp_path / "ray"),
            failure_config=FailureConfig(max_failures=3),
            callbacks=[StopOnFatalError()],
        ),
    )
    with pytest.raises(Exception) as caught:
        trainer.fit()
    fatal = fatal_cause(caught.value)
    assert fatal is not None, caught.value
    assert str(fatal).startswith("rank 0 setup: FileNotFoundError: ") and "dataset.json not found" in str(
        fatal
    )
