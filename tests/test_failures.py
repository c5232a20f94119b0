"""Only real faults are retried: a deterministic worker error ends a Ray Train run on its first attempt.

Real Ray Train runs on the session cluster: one attempt for a FatalRunError despite max_failures=3, every
retry for an ordinary error, and the real worker loop classifying a data-layout error as fatal.
"""

from __future__ import annotations

import re
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


def test_an_explained_error_is_one_line_in_ray_trains_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Ray Train logs a worker's error with its traceback in the worker (a formatted string, inside its
    except block) and in the controller (as exc_info, wrapped); an explained FatalRunError becomes one line
    there, any other error keeps its traceback."""
    import logging
    import pickle

    from dmltrain.service.logs import CONTROLLER_LOGGERS, WORKER_LOGGERS, shorten_explained_errors

    class Wrapped(Exception):  # Ray's ControllerError keeps the cause as controller_failure
        def __init__(self, cause: BaseException) -> None:
            super().__init__(f"Training failed due to controller error:\n{cause}")
            self.controller_failure = cause

    shorten_explained_errors([*WORKER_LOGGERS, *CONTROLLER_LOGGERS])
    worker, controller = logging.getLogger(WORKER_LOGGERS[0]), logging.getLogger(CONTROLLER_LOGGERS[0])
    message = "rank 0 step 3: SampleError: sample 'k' of shard s.tar: cannot decode/transform the image: x"
    for explained in (True, False):
        caplog.clear()
        error = pickle.loads(pickle.dumps(FatalRunError(message, explained=explained)))  # as Ray ships it
        assert error.explained is explained
        with caplog.at_level(logging.INFO):
            try:
                raise error
            except FatalRunError as exc:
                import traceback

                worker.error(f"Error in training function:\n{traceback.format_exc()}")
                controller.exception("Error in control loop iteration: %s", exc)
                wrapped = Wrapped(exc)
                controller.info(
                    "[FailurePolicy] RAISE\n  Source: controller", exc_info=(Wrapped, wrapped, None)
                )
        text = caplog.text
        if explained:
            assert [r.getMessage() for r in caplog.records] == [
                f"Error in training function: {message}",
                f"Error in control loop iteration: {message}",
                f"[FailurePolicy] RAISE: {message}",
            ]
            assert "Traceback" not in text and len(text.strip().splitlines()) == 3, text
        else:
            assert text.count("Traceback") == 2 and "Source: controller" in text, text


def test_a_damaged_image_ends_the_real_driver_in_a_few_lines(
    ray_cluster, glyphs_root: Path, tmp_path: Path
) -> None:
    """`python -m dmltrain.run` on shards whose images cannot be decoded (sizes intact, so only decoding
    finds it): Ray Train used to print about 90 lines of tracebacks from the worker and the controller
    above the driver's one `error:` line; now each says the error's one line, and nothing is retried."""
    import os
    import shutil
    import subprocess
    import tarfile

    root = tmp_path / "glyphs"
    shutil.copytree(glyphs_root, root)
    for shard in sorted(root.glob("train-*.tar")):
        with tarfile.open(shard) as tar:
            offsets = [m.offset_data for m in tar.getmembers() if m.name.endswith(".png")]
        data = bytearray(shard.read_bytes())
        for offset in offsets:
            data[offset : offset + 8] = b"\0" * 8  # the PNG signature
        shard.write_bytes(bytes(data))
    driver = subprocess.run(
        [
            sys.executable,
            "-m",
            "dmltrain.run",
            str(Path(__file__).parents[1] / "configs" / "quickstart.yaml"),
            f"data.root={root}",
            "data.prepare=null",
            "train.steps=4",
            "train.eval_at_start=false",
            f"run.storage_path={tmp_path / 'ray_results'}",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "run.max_failures=2",
            "scaling.topology=single-node",  # joins this session's cluster (RAY_ADDRESS)
        ],
        cwd=tmp_path,
        env={**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = driver.stdout + driver.stderr
    assert driver.returncode != 0, output[-4000:]
    line = re.search(
        r"error: (rank 0 step 1: SampleError: sample '[^']+' of shard \S+: cannot decode.*)", output
    )
    assert line is not None, output[-4000:]
    assert output.count(f"Error in training function: {line.group(1)}") == 1, output[-4000:]
    # The worker's and the controller's own lines: no traceback frames (other Ray actors may print their
    # own, e.g. the PlacementGroupCleaner when another Ray instance runs on the machine).
    train_lines = [
        line for line in output.splitlines() if "RayTrainWorker" in line or "TrainController" in line
    ]
    assert not [line for line in train_lines if "Traceback" in line or 'File "' in line], output[-4000:]
    assert len([line for line in output.splitlines() if "SampleError" in line]) == 4, output[-4000:]
