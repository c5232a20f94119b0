"""The per-worker loop in one process (world of 1, no Ray): NaN steps, checkpoint round trip, logging.

Ray's part (worker groups, restarts, job submission) is covered end to end in test_service.py; here the
loop runs in-process against real glyph shards and a real MLflow sqlite store, so each case takes seconds.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from mlflow.tracking import MlflowClient

from dmltrain.service.config import ExperimentConfig, flatten, load_config, to_yaml
from dmltrain.service.tracking import start_or_resume_run
from dmltrain.service.train import NonFiniteLossError, WorkerLoop

REPO = Path(__file__).parents[1]


class _Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path

    def as_directory(self):  # same protocol as ray.train.Checkpoint
        from contextlib import nullcontext

        return nullcontext(str(self.path))


@dataclass
class LocalContext:
    """Stands in for Ray Train's worker context in a single process: checkpoints go to a folder."""

    root: Path
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    restore_from: Path | None = None
    reports: list[dict[str, Any]] = field(default_factory=list)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def get_checkpoint(self) -> _Checkpoint | None:
        return _Checkpoint(self.restore_from) if self.restore_from else None

    def report(self, metrics: dict[str, float], directory: str | None, upload: str = "sync") -> None:
        self.reports.append(metrics)
        if directory:
            target = self.root / f"checkpoint_{metrics['step']:04d}"
            shutil.copytree(directory, target)
            if upload == "async":  # as Ray does once an asynchronous upload is done
                shutil.rmtree(directory)


def _setup(tmp_path: Path, glyphs: Path, *overrides: str) -> tuple[ExperimentConfig, str, str]:
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"data.root={glyphs}",
            "data.prepare=null",
            "data.loader_workers=0",
            "scaling.num_workers=1",
            "train.global_batch_size=16",
            "train.chunk_size=8",
            "train.log_every=1",
            "train.eval_at_start=false",
            "eval.max_images=200",
            "eval.grid_queries=2",
            *overrides,
        ],
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id, _ = start_or_resume_run(uri, "loop", str(tmp_path), "loop", flatten(config), to_yaml(config))
    return config, run_id, uri


def test_checkpoint_round_trip_continues_the_run(glyphs_root: Path, tmp_path: Path) -> None:
    config, run_id, uri = _setup(
        tmp_path, glyphs_root, "train.steps=4", "train.checkpoint_every=2", "train.eval_every=4"
    )
    first = LocalContext(tmp_path)
    loop = WorkerLoop(config, run_id, uri, first)
    loop.run()
    assert [r["step"] for r in first.reports] == [2, 4] and "eval/test/recall@1" in first.reports[-1]
    # Only evaluated checkpoints carry a real score for Ray's best-checkpoint ranking.
    assert first.reports[0]["checkpoint_score"] == float("-inf")
    assert first.reports[1]["checkpoint_score"] == first.reports[1]["eval/test/recall@1"]
    final_weights = {k: v.clone() for k, v in loop.net.state_dict().items()}
    # Where the time went (time/* in MLflow): the parts fit inside the loop's wall time.
    t = {k.removeprefix("time/"): v for k, v in MlflowClient(uri).get_run(run_id).data.metrics.items()}
    assert t["eval_seconds"] > 0 and t["checkpoint_seconds"] > 0 and t["log_seconds"] > 0
    assert t["comm_seconds"] <= t["engine_seconds"]
    assert t["data_seconds"] + t["engine_seconds"] + t["update_seconds"] <= t["step_seconds"]
    parts = t["step_seconds"] + t["eval_seconds"] + t["checkpoint_seconds"] + t["log_seconds"]
    assert parts <= t["loop_seconds"] <= parts + 5.0

    # A fresh loop restored from the step-2 checkpoint replays steps 3-4 from the same stream position.
    again = LocalContext(tmp_path / "again", restore_from=tmp_path / "checkpoint_0002")
    (tmp_path / "again").mkdir()
    resumed = WorkerLoop(config, run_id, uri, again)
    assert resumed.step == 2 and resumed.stream.step == 2
    resumed.run()
    for key, value in resumed.net.state_dict().items():
        torch.testing.assert_close(value, final_weights[key], msg=key)
    steps = [m.step for m in MlflowClient(uri).get_metric_history(run_id, "train/loss")]
    assert steps == [1, 2, 3, 4]  # the replayed steps were not logged a second time


def test_nan_steps_are_skipped_then_fail_clearly(glyphs_root: Path, tmp_path: Path) -> None:
    config, run_id, uri = _setup(
        tmp_path, glyphs_root, "train.steps=10", "train.max_skipped_steps=2", "train.eval_every=100"
    )
    loop = WorkerLoop(config, run_id, uri, LocalContext(tmp_path))
    with torch.no_grad():
        loop.net.embedding.bias.fill_(float("nan"))  # every embedding becomes NaN
    before = {k: v.clone() for k, v in loop.net.state_dict().items()}
    with pytest.raises(NonFiniteLossError, match="max_skipped_steps=2"):
        loop.run()
    assert loop.counters.skipped_steps == 3
    for key, value in before.items():  # no update reached the weights or the BatchNorm statistics
        torch.testing.assert_close(loop.net.state_dict()[key], value, msg=key, equal_nan=True)
    skipped = MlflowClient(uri).get_metric_history(run_id, "train/skipped_steps")
    assert [m.value for m in skipped] == [1.0, 2.0]
