"""The best evaluation so far: which checkpoint Ray keeps as best, and when training stops early.

Every checkpoint reported to Ray carries ``checkpoint_score``: the chosen metric where the checkpoint was
evaluated (capped just below the best so far unless it beat it by ``train.early_stopping_min_delta``), else
the worst possible value, so Ray's ``CheckpointConfig(checkpoint_score_attribute=...)`` ranks only evaluated
weights, ranks them as the tracker does, and drops an unevaluated checkpoint as soon as it is no longer the
latest. The tracker's state is checkpointed, so patience survives a restart.
"""

from __future__ import annotations

import logging
import math
import sys
from dataclasses import dataclass
from typing import Any, Literal

SCORE_KEY = "checkpoint_score"
log = logging.getLogger("dmltrain.service.best")


def worst_score(mode: Literal["max", "min"]) -> float:
    """The value that ranks last for Ray under ``mode``.

    Finite on purpose: Ray Train keeps its checkpoint list in a JSON snapshot in storage, where an infinite
    score becomes null, and a relaunch (driver loss, resubmission) then fails as soon as it registers a new
    checkpoint against a restored one ("unsupported operand type(s) for *: 'float' and 'NoneType'")."""
    return -sys.float_info.max if mode == "max" else sys.float_info.max


def is_scored(value: Any) -> bool:
    """Whether a reported ``checkpoint_score`` is a real evaluation (not :func:`worst_score`, NaN or null)."""
    return isinstance(value, int | float) and math.isfinite(value) and abs(value) < sys.float_info.max


def metric_names(evaluations: list[str], ks: tuple[int, ...]) -> list[str]:
    """Every key an evaluation produces (``eval/<name>/<metric>``), for checking ``train.best_metric``."""
    metrics = [f"recall@{k}" for k in ks] + ["map", "map@r", "r_precision"]
    return [f"eval/{name}/{metric}" for name in evaluations for metric in metrics]


def resolve_best_metric(best_metric: str | None, evaluations: list[str], ks: tuple[int, ...]) -> str | None:
    """``auto`` -> the first evaluation's recall@1 (the papers' headline metric); any other value must be
    a key the data set's evaluations produce. Raises ValueError naming ``train.best_metric`` otherwise."""
    if best_metric is None:
        return None
    if not evaluations:
        raise ValueError("train.best_metric: the data set lists no evaluations to rank checkpoints by")
    if best_metric == "auto":
        return f"eval/{evaluations[0]}/recall@{min(ks)}" if 1 not in ks else f"eval/{evaluations[0]}/recall@1"
    known = metric_names(evaluations, ks)
    if best_metric not in known:
        raise ValueError(f"train.best_metric={best_metric!r} is not an evaluation metric; one of {known}")
    return best_metric


class BestMetricError(ValueError):
    """The metric that ranks checkpoints is missing or NaN (e.g. no test query has a positive): a restart
    evaluates the same checkpoint to the same value, so it is not retried."""


@dataclass
class BestTracker:
    """Best value of ``metric`` and the step it was reached at; counts evaluations since."""

    metric: str
    mode: Literal["max", "min"] = "max"
    min_delta: float = 0.0
    patience: int | None = None
    score: float | None = None
    step: int = -1
    stale: int = 0  # evaluations since the best

    def update(self, metrics: dict[str, float], step: int) -> bool:
        """Take an evaluation's metrics; True when it is a new best. A missing or NaN value is an error."""
        if self.metric not in metrics:
            raise BestMetricError(f"train.best_metric={self.metric!r} is not among the evaluation's metrics")
        value = float(metrics[self.metric])
        if math.isnan(value):
            raise BestMetricError(f"train.best_metric={self.metric!r} is NaN at step {step}")
        better = self.score is None or (
            value > self.score + self.min_delta if self.mode == "max" else value < self.score - self.min_delta
        )
        if better:
            self.score, self.step, self.stale = value, step, 0
        else:
            self.stale += 1
        return better

    def checkpoint_score(self, metrics: dict[str, float], step: int) -> float:
        """``checkpoint_score`` for the checkpoint of `step`, after :meth:`update`, so that Ray ranks
        checkpoints as this tracker does: the metric where `step` is the best; just below the best where
        `step` was evaluated but did not beat it by ``min_delta`` (its metric may be higher: Ray would then
        keep and publish it as the best and could delete the best step's checkpoint); the worst score where
        `step` was not evaluated."""
        if self.metric not in metrics:
            return worst_score(self.mode)
        value = float(metrics[self.metric])
        if self.score is None or step == self.step:
            return value
        if self.mode == "max":
            return min(value, math.nextafter(self.score, -math.inf))
        return max(value, math.nextafter(self.score, math.inf))

    @property
    def should_stop(self) -> bool:
        return self.patience is not None and self.stale >= self.patience

    def state_dict(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "step": self.step,
            "stale": self.stale,
            "metric": self.metric,
            "mode": self.mode,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """The saved best, unless it ranks another metric or direction (a resume that changed
        ``train.best_metric``/``best_mode``): then the best starts afresh, with a warning; a MAP@R was
        compared with a Recall@1 best, and patience ran out on improvements it could not see."""
        if not state:
            return
        saved = (state.get("metric", self.metric), state.get("mode", self.mode))  # older checkpoints: neither
        if saved != (self.metric, self.mode):
            log.warning(
                "the checkpoint's best ranks %s (%s); this run ranks %s (%s): the best starts afresh",
                *saved,
                self.metric,
                self.mode,
            )
            return
        self.score, self.step, self.stale = state["score"], int(state["step"]), int(state["stale"])
