"""Training quality on held-out classes, through the real service: the README's study (issue 11 §2).

    python bench/quality.py [--quick] [--only losses,batch,batch_full,workers,bn] [--out quality.md]

Each study is a sweep file in configs/sweeps/ run by `dmltrain sweep` (Ray Tune, one trial at a time on a
2-core machine; each trial is a full `python -m dmltrain.run` launch of the bundled glyphs, 789 train
classes, evaluated on the 788 held-out classes). Results are MLflow runs: one parent run per study with a
nested child run per trial (curves, plots, models) and the summary table and comparison plots on the
parent. This script runs the sweeps (by default all but batch_full) and prints the tables the README shows:

- losses: every loss against the untrained network (step 0 of every trial: the same seeded weights) and
  raw pixels (quality_losses.yaml);
- batch: one loss at global batch 64, 256, 1024 and 4096 at equal optimizer steps and at equal images
  seen, with each run's training peak memory (rank 0's resident set) and time per step
  (quality_batch.yaml: 6 steps and 24,576 images; batch_full, quality_batch_full.yaml: the issue's scale,
  24 steps and 98,304 images, about 4x the time; not in the default run);
- workers: the same run at 1 and 2 Ray workers with the same global batch, and a second sampler seed as
  the yardstick of run-to-run noise (quality_workers.yaml);
- bn: frozen against live BatchNorm (quality_bn.yaml).

Relaunching continues where it stopped (finished trials are read back from MLflow, not re-trained).
`--quick` runs every trial for 2 steps with a 600-image evaluation (a smoke test of the whole path, as a
separate sweep name). Timing columns are only comparable within one run on an otherwise idle machine;
the script prints the load average around each sweep so contended timings can be labelled as such.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dmltrain.service.sweeps import SweepOutcome, load_sweep, run_sweep  # noqa: E402
from dmltrain.service.sweeps.summary import markdown_table, untrained  # noqa: E402

STUDIES = ("losses", "batch", "batch_full", "workers", "bn")
DEFAULT_STUDIES = ("losses", "batch", "workers", "bn")
QUICK = ("train.steps=2", "train.eval_every=2", "train.log_every=1", "eval.max_images=600")


def sweep_file(study: str) -> Path:
    return REPO / "configs" / "sweeps" / f"quality_{study}.yaml"


def _rows(outcome: SweepOutcome) -> list[dict[str, Any]]:
    return [r.row() for r in outcome.results]


def _trials(outcome: SweepOutcome) -> list[dict[str, Any]]:
    return [row for row in _rows(outcome) if row["kind"] == "trial"]


def _curve(outcome: SweepOutcome, label: str, key: str) -> list[tuple[int, float]]:
    for result in outcome.results:
        if result.label == label:
            return result.history.get(key, [])
    return []


def losses_table(outcome: SweepOutcome) -> str:
    rows: list[dict[str, Any]] = []
    for row in _rows(outcome):
        if row["kind"] == "baseline":
            rows.append({"method": f"{row['label']} (no training)", **row})
    base = untrained(outcome.results)
    if base is not None:
        rows.append({"method": "untrained network (step 0)", **base})
    for row in _trials(outcome):
        rows.append({"method": row["label"], **row})
    columns = [
        ("method", "method"),
        ("global_batch_size", "global batch"),
        ("steps", "steps"),
        ("recall_at_1", "R@1"),
        ("map_at_r", "MAP@R"),
        ("step_seconds", "s/step"),
    ]
    return markdown_table(rows, columns)


def batch_table(outcome: SweepOutcome) -> str:
    trials = _trials(outcome)
    steps = sorted({r["steps"] for r in trials if r["steps"]})
    images = [r["images_seen"] for r in trials if r["images_seen"]]
    equal_steps = min(steps) if steps else None  # the equal-steps arm: every batch at the fewest steps
    budget = max(images) if images else None  # the equal-images arm: every batch at the largest budget
    out = []
    for batch in sorted({r["global_batch_size"] for r in trials}):
        same_b = [r for r in trials if r["global_batch_size"] == batch]
        by_steps = next((r for r in same_b if r["steps"] == equal_steps), None)
        by_images = next((r for r in same_b if r["images_seen"] == budget), None)
        timing = by_images or by_steps or {}
        out.append(
            {
                "batch": batch,
                "s_steps": by_steps and by_steps["steps"],
                "s_r1": by_steps and by_steps["recall_at_1"],
                "s_map": by_steps and by_steps["map_at_r"],
                "i_steps": by_images and by_images["steps"],
                "i_r1": by_images and by_images["recall_at_1"],
                "i_map": by_images and by_images["map_at_r"],
                "peak": max((r["peak_rss_mb"] or 0.0) for r in same_b) or None,
                "step_s": timing.get("step_seconds"),
                "ips": timing.get("images_per_second"),
            }
        )
    columns = [
        ("batch", "global batch"),
        ("s_steps", f"steps (equal steps, {equal_steps})"),
        ("s_r1", "R@1"),
        ("s_map", "MAP@R"),
        ("i_steps", f"steps (equal images, {budget:,})" if budget else "steps (equal images)"),
        ("i_r1", "R@1"),
        ("i_map", "MAP@R"),
        ("peak", "peak MiB (rank 0)"),
        ("step_s", "s/step"),
        ("ips", "images/s"),
    ]
    return markdown_table(out, columns)


def workers_table(outcome: SweepOutcome) -> str:
    trials = _trials(outcome)
    reference = next((r for r in trials if r["workers"] == 2), trials[0] if trials else None)
    ref_loss = dict(_curve(outcome, reference["label"], "train/loss")) if reference else {}
    rows = []
    for row in trials:
        loss = dict(_curve(outcome, row["label"], "train/loss"))
        common = sorted(set(loss) & set(ref_loss))
        gap = max((abs(loss[s] - ref_loss[s]) for s in common), default=None)
        final = loss[max(loss)] if loss else None
        rows.append({**row, "final_loss": final, "loss_gap": gap if row is not reference else None})
    columns = [
        ("label", "run"),
        ("workers", "Ray workers"),
        ("global_batch_size", "global batch"),
        ("final_loss", "final loss"),
        ("loss_gap", f"max \\|loss - {reference['label'] if reference else '?'}\\|"),
        ("recall_at_1", "R@1"),
        ("map_at_r", "MAP@R"),
        ("step_seconds", "s/step"),
    ]
    return markdown_table(rows, columns, digits=4)


def bn_table(outcome: SweepOutcome) -> str:
    columns = [
        ("label", "BatchNorm"),
        ("steps", "steps"),
        ("recall_at_1_step0", "R@1 step 0"),
        ("recall_at_1", "R@1"),
        ("map_at_r", "MAP@R"),
        ("step_seconds", "s/step"),
    ]
    return markdown_table(_trials(outcome), columns)


TABLES = {
    "losses": losses_table,
    "batch": batch_table,
    "batch_full": batch_table,
    "workers": workers_table,
    "bn": bn_table,
}


def run_study(study: str, extra: Sequence[str], quick: bool) -> tuple[SweepOutcome, str]:
    path = sweep_file(study)
    sweep = load_sweep(path, extra)
    if quick:
        sweep = load_sweep(path, extra, name=f"{sweep.spec.name}-quick")
    before = os.getloadavg()[0]
    started = time.perf_counter()
    outcome = run_sweep(sweep)
    minutes = (time.perf_counter() - started) / 60
    after = os.getloadavg()[0]
    note = (
        f"{sweep.spec.name}: {len(sweep.trials)} trials in {minutes:.1f} min; 1-minute load average "
        f"{before:.1f} before, {after:.1f} after, on {os.cpu_count()} cores"
        + (" (contended: timings are rough)" if max(before, after) > 4 else "")
    )
    return outcome, note


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 steps a trial, 600-image evaluation")
    parser.add_argument(
        "--only", default=",".join(DEFAULT_STUDIES), help=f"comma-separated subset of {STUDIES}"
    )
    parser.add_argument("--data", default=None, help="glyph data root (default: the quickstart's)")
    parser.add_argument("--out", default=None, help="also write the tables (markdown) to this file")
    parser.add_argument("overrides", nargs="*", help="dotted overrides for every trial of every study")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    studies = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(studies) - set(STUDIES))
    if unknown:
        parser.error(f"unknown studies {unknown}; choose from {STUDIES}")
    extra = list(args.overrides) + (list(QUICK) if args.quick else [])
    if args.data:
        extra += [f"data.root={args.data}"]
    sections, failed = [], False
    for study in studies:
        outcome, note = run_study(study, extra, args.quick)
        failed |= bool(outcome.failed or outcome.unfinished)
        text = (
            f"## {study}: `dmltrain sweep {sweep_file(study).relative_to(REPO)}`\n\n"
            f"{TABLES[study](outcome)}\n\n{note}; MLflow parent run {outcome.parent_run_id}\n"
        )
        print("\n" + text, flush=True)
        sections.append(text)
        for label, error in outcome.failed.items():
            print(f"trial {label!r} failed: {error}", file=sys.stderr)
        for label, status in outcome.unfinished.items():
            print(f"trial {label!r} did not finish (MLflow status {status})", file=sys.stderr)
    if args.out:
        Path(args.out).write_text("\n".join(sections))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
