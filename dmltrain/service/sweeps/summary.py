"""What a sweep found, read back from MLflow (the record of every trial, resumed or not).

Each child run of the sweep's parent becomes one row: its final evaluation, its evaluation at step 0 (the
untrained network: every trial starts from the same seeded weights), the training peak memory and time per
step, and its curves. The parent run gets the table (``summary.md``, ``summary.json``) and comparison plots.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from dmltrain.service.sweeps.trial import BASELINE_TAG, TRIAL_TAG
from dmltrain.service.tracking import SEGMENT_METRIC

RECALL, MAP_R = "recall_at_1", "map_at_r"
_CURVES = ("train/loss", "train/step_seconds", "train/peak_rss_mb", "train/images_per_second")


@dataclass
class TrialResult:
    """One child run of a sweep, as MLflow holds it."""

    label: str
    run_id: str
    status: str
    kind: str  # "trial" or "baseline"
    params: dict[str, str]
    metrics: dict[str, float]  # latest value of every metric (the final evaluation for eval/*)
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # step-sorted
    wall_seconds: float | None = None

    @property
    def eval_prefix(self) -> str | None:
        """``eval/<split>/`` of the first evaluation that reports Recall@1 (glyphs: ``eval/test/``)."""
        keys = sorted(k for k in self.metrics if k.startswith("eval/") and k.endswith("/" + RECALL))
        return keys[0][: -len(RECALL)] if keys else None

    def final(self, metric: str) -> float | None:
        prefix = self.eval_prefix
        return self.metrics.get(prefix + metric) if prefix else None

    def at_step(self, metric: str, step: int) -> float | None:
        prefix = self.eval_prefix
        values = dict(self.history.get(prefix + metric, [])) if prefix else {}
        return values.get(step)

    def curve(self, metric: str) -> list[tuple[int, float]]:
        prefix = self.eval_prefix
        return self.history.get(prefix + metric, []) if prefix else []

    def steady_mean(self, key: str) -> float | None:
        """Mean of a logged training series leaving out its first window (start-up: first batch, warm-up)."""
        values = [v for _, v in self.history.get(key, []) if math.isfinite(v)]
        values = values[1:] if len(values) > 1 else values
        return sum(values) / len(values) if values else None

    def peak(self, key: str) -> float | None:
        values = [v for _, v in self.history.get(key, []) if math.isfinite(v)]
        return max(values) if values else None

    def steps_trained(self) -> int | None:
        """The last step the run logged anything at. Not the ``train.steps`` param: params keep the first
        launch's values, so a trial extended by a relaunch (or stopped early) would be misreported."""
        logged = [step for series in self.history.values() for step, _ in series]
        return max(logged) if logged else _int(self.params.get("train.steps"))

    def row(self) -> dict[str, Any]:
        """The flat summary of this run (what ``summary.json`` and the tables hold)."""
        batch = _int(self.params.get("train.global_batch_size"))
        steps = self.steps_trained()
        return {
            "label": self.label,
            "kind": self.kind,
            "status": self.status,
            "run_id": self.run_id,
            "loss": self.params.get("loss.name"),
            "global_batch_size": batch,
            "steps": steps,
            "images_seen": batch * steps if batch and steps else None,
            "workers": _int(self.params.get("scaling.num_workers")),
            "recall_at_1": self.final(RECALL),
            "map_at_r": self.final(MAP_R),
            "recall_at_1_step0": self.at_step(RECALL, 0),
            "map_at_r_step0": self.at_step(MAP_R, 0),
            "step_seconds": self.steady_mean("train/step_seconds"),
            "images_per_second": self.steady_mean("train/images_per_second"),
            "peak_rss_mb": self.peak("train/peak_rss_mb"),
            "wall_seconds": self.wall_seconds,
        }


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def collect(tracking_uri: str, parent_run_id: str) -> list[TrialResult]:
    """Every child run of ``parent_run_id``, with the metric histories the summary needs."""
    client = MlflowClient(tracking_uri)
    parent = client.get_run(parent_run_id)
    runs = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`{MLFLOW_PARENT_RUN_ID}` = '{parent_run_id}'",
        max_results=10_000,
    )
    results = []
    # Of a baseline run more than once (stores of versions that started a new run after a stopped one),
    # the finished run stands for it, else the newest (MLflow returns the newest first).
    chosen: dict[str, str] = {}
    for run in sorted(runs, key=lambda r: r.info.status != "FINISHED"):
        chosen.setdefault(run.data.tags.get(BASELINE_TAG, run.info.run_id), run.info.run_id)
    for run in runs:
        tags = run.data.tags
        if BASELINE_TAG in tags and chosen[tags[BASELINE_TAG]] != run.info.run_id:
            continue
        wanted = [k for k in run.data.metrics if k.startswith("eval/") or k in (*_CURVES, SEGMENT_METRIC)]
        logged = {key: client.get_metric_history(run.info.run_id, key) for key in wanted}
        history = {
            key: sorted((m.step, m.value) for m in logged[key]) for key in wanted if key != SEGMENT_METRIC
        }
        relaunches = [m.timestamp for m in logged.get(SEGMENT_METRIC, []) if m.value > 1]
        times = [m.timestamp for key, ms in logged.items() if key != SEGMENT_METRIC for m in ms]
        results.append(
            TrialResult(
                label=tags.get(TRIAL_TAG, run.info.run_name or run.info.run_id),
                run_id=run.info.run_id,
                status=run.info.status,
                kind="baseline" if BASELINE_TAG in tags else "trial",
                params=dict(run.data.params),
                metrics=dict(run.data.metrics),
                history=history,
                wall_seconds=active_seconds(run.info.start_time, run.info.end_time, relaunches, times),
            )
        )
    return results


def active_seconds(
    start_ms: int | None, end_ms: int | None, relaunches_ms: Sequence[int], metric_times_ms: Sequence[int]
) -> float | None:
    """Seconds a run was at work: MLflow's start-to-end span, less the idle time before each relaunch (a
    stopped trial resumed the next day would otherwise count the night). A gap runs from the last metric
    logged before the relaunch to the relaunch's ``run/segment`` record."""
    if start_ms is None or end_ms is None:  # a run that never ended has no wall time yet
        return None
    total = end_ms - start_ms
    previous = start_ms
    for relaunch in sorted(relaunches_ms):
        before = [t for t in metric_times_ms if t < relaunch]
        # from the later of the last metric and the previous relaunch: a launch stopped before it logged
        # anything must not have its gap counted again from an older metric
        total -= relaunch - max(max(before, default=start_ms), previous)
        previous = relaunch
    return max(total, 0) / 1000


def order(results: Sequence[TrialResult], labels: Sequence[str]) -> list[TrialResult]:
    """Baselines first, then trials in the sweep file's order (unknown labels last, by name)."""
    rank = {label: i for i, label in enumerate(labels)}
    return sorted(results, key=lambda r: (r.kind != "baseline", rank.get(r.label, len(rank)), r.label))


def untrained(results: Sequence[TrialResult]) -> dict[str, float] | None:
    """Step-0 evaluation of the first trial that has one: the untrained network every trial starts from."""
    for result in results:
        r1, mr = result.at_step(RECALL, 0), result.at_step(MAP_R, 0)
        if result.kind == "trial" and r1 is not None and mr is not None:
            return {RECALL: r1, MAP_R: mr}
    return None


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return "-"
        return f"{value:.{digits}f}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def markdown_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str]], digits: int = 3
) -> str:
    """A GitHub-flavoured table of ``rows`` with ``columns`` = (key, header) pairs."""
    lines = [
        "| " + " | ".join(h for _, h in columns) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(columns))) + "|",
    ]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(k), digits) for k, _ in columns) + " |")
    return "\n".join(lines)


SUMMARY_COLUMNS = (
    ("label", "trial"),
    ("status", "status"),
    ("global_batch_size", "global batch"),
    ("steps", "steps"),
    ("images_seen", "images seen"),
    ("recall_at_1", "R@1"),
    ("map_at_r", "MAP@R"),
    ("recall_at_1_step0", "R@1 step 0"),
    ("peak_rss_mb", "peak MiB"),
    ("step_seconds", "s/step"),
    ("wall_seconds", "wall s"),
)


def summary_markdown(results: Sequence[TrialResult], title: str) -> str:
    rows = [r.row() for r in results]
    base = untrained(results)
    if base is not None:
        rows.insert(0, {"label": "untrained network (step 0)", "kind": "baseline", **base})
    return f"# {title}\n\n" + markdown_table(rows, SUMMARY_COLUMNS) + "\n"


def log_summary(tracking_uri: str, parent_run_id: str, results: Sequence[TrialResult], title: str) -> None:
    """Table, JSON rows and comparison plots on the parent run; headline metrics per trial as parent
    metrics (``<label>/recall_at_1``) so the MLflow UI can chart them."""
    from dmltrain.plots import comparison_curves

    client = MlflowClient(tracking_uri)
    rows = [r.row() for r in results]
    base = untrained(results)
    client.log_text(parent_run_id, summary_markdown(results, title), "summary.md")
    client.log_text(
        parent_run_id,
        json.dumps({"untrained": base, "runs": rows, "curves": [_curves(r) for r in results]}, indent=1),
        "summary.json",
    )
    references = {f"{r.label} (no training)": r.final(RECALL) for r in results if r.kind == "baseline"}
    if base is not None:
        references["untrained network"] = base[RECALL]
    references = {k: v for k, v in references.items() if v is not None}
    trials = [r for r in results if r.kind == "trial" and r.curve(RECALL)]
    for metric, name in ((RECALL, "Recall@1"), (MAP_R, "MAP@R")):
        refs = references if metric == RECALL else _map_references(results, base)
        by_step = {r.label: _xy(r.curve(metric)) for r in trials}
        if by_step or refs:
            figure = comparison_curves(
                by_step, xlabel="step", ylabel=f"{name} (held-out)", baselines=refs, title=title
            )
            client.log_figure(parent_run_id, figure, f"plots/{metric}_by_step.png")
        by_images = {}
        for r in trials:
            batch = r.row()["global_batch_size"]
            if not batch:  # unknown: left out, not drawn as a vertical line at x = 0
                continue
            steps, values = _xy(r.curve(metric))
            by_images[r.label] = ([s * batch for s in steps], values)
        if by_images:
            figure = comparison_curves(
                by_images, xlabel="images seen", ylabel=f"{name} (held-out)", baselines=refs, title=title
            )
            client.log_figure(parent_run_id, figure, f"plots/{metric}_by_images.png")
    losses = {r.label: _xy(r.history.get("train/loss", [])) for r in trials if r.history.get("train/loss")}
    if losses:
        figure = comparison_curves(losses, xlabel="step", ylabel="training loss", title=title)
        client.log_figure(parent_run_id, figure, "plots/train_loss.png")
    _log_parent_metrics(client, parent_run_id, rows)


def _map_references(results: Sequence[TrialResult], base: dict[str, float] | None) -> dict[str, float]:
    refs = {f"{r.label} (no training)": r.final(MAP_R) for r in results if r.kind == "baseline"}
    if base is not None:
        refs["untrained network"] = base[MAP_R]
    return {k: v for k, v in refs.items() if v is not None}


def _xy(points: Sequence[tuple[int, float]]) -> tuple[list[float], list[float]]:
    return [float(s) for s, _ in points], [float(v) for _, v in points]


def _curves(result: TrialResult) -> dict[str, Any]:
    return {"label": result.label, **{key: result.history.get(key, []) for key in sorted(result.history)}}


def _log_parent_metrics(client: MlflowClient, parent_run_id: str, rows: Sequence[Mapping[str, Any]]) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = []
    for row in rows:
        for key in ("recall_at_1", "map_at_r", "step_seconds", "peak_rss_mb"):
            value = row.get(key)
            if isinstance(value, float) and math.isfinite(value):
                name = "".join(c if c.isalnum() or c in "_-./ " else "_" for c in f"{row['label']}/{key}")
                metrics.append(Metric(name, value, now, 0))
    for start in range(0, len(metrics), 100):
        client.log_batch(parent_run_id, metrics=metrics[start : start + 100])


def as_dicts(results: Sequence[TrialResult]) -> list[dict[str, Any]]:
    return [asdict(r) for r in results]
