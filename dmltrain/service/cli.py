"""`dmltrain` console script (also `python -m dmltrain.service.cli`).

Each subcommand is a (register, run) pair in `COMMANDS`, so `train` / `evaluate` slot in beside `prepare`
without touching the others.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Register = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


def _register_prepare(parser: argparse.ArgumentParser) -> None:
    from dmltrain.data.datasets import FORMATS

    parser.description = (
        "Convert a data set in its published layout into WebDataset shards plus dataset.json. "
        "Re-running is safe: an identical build is left alone, an interrupted one resumes."
    )
    parser.add_argument("format", choices=FORMATS, help="source layout")
    parser.add_argument("source", help="source directory (CSV file for csv; '-' for glyphs)")
    parser.add_argument("out_dir", help="output directory for shards and dataset.json")
    parser.add_argument("--shard-size", type=int, default=None, help="images per shard (default: ~64 shards)")
    parser.add_argument("--group-size", type=int, default=32, help="max images of a class stored together")
    parser.add_argument("--resize", type=int, default=None, help="re-encode with this shorter side (pixels)")
    parser.add_argument("--seed", type=int, default=0, help="seed for shard layout and class splits")
    parser.add_argument("--workers", type=int, default=1, help="processes writing shards in parallel")
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical build exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--test-fraction",
        type=float,
        default=None,
        help="folder/csv/glyphs: share of classes held out for test",
    )
    parser.add_argument("--image-root", default=None, help="csv: folder the paths are relative to")
    parser.add_argument(
        "--split-dir", default=None, help="inaturalist: folder with the Smooth-AP split files"
    )
    parser.add_argument("--min-faces", type=int, default=None, help="glyphs: faces a character needs (12)")
    parser.add_argument("--image-size", type=int, default=None, help="glyphs: image side in pixels (64)")
    parser.add_argument(
        "--max-classes", type=int, default=None, help="glyphs: keep only the first N characters"
    )


def _run_prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dmltrain.data.datasets import SourceLayoutError
    from dmltrain.data.datasets.glyphs import DEFAULT_IMAGE_SIZE, DEFAULT_MIN_FACES
    from dmltrain.data.prepare import prepare

    options: dict[str, object] = {"test_fraction": args.test_fraction}
    if args.format == "csv":
        options["image_root"] = Path(args.image_root) if args.image_root else None
    if args.format == "inaturalist":
        options["split_dir"] = Path(args.split_dir) if args.split_dir else None
    if args.format == "glyphs":
        options["test_fraction"] = 0.5 if args.test_fraction is None else args.test_fraction
        options["min_faces"] = args.min_faces or DEFAULT_MIN_FACES
        options["image_size"] = args.image_size or DEFAULT_IMAGE_SIZE
        options["max_classes"] = args.max_classes
    try:
        info = prepare(
            args.format,
            args.source,
            args.out_dir,
            shard_size=args.shard_size,
            group_size=args.group_size,
            seed=args.seed,
            resize=args.resize,
            workers=args.workers,
            force=args.force,
            progress=not args.quiet,
            **options,
        )
    except (SourceLayoutError, ValueError, FileNotFoundError) as exc:
        print(f"dmltrain prepare: error: {exc}", file=sys.stderr)
        return 2
    total = sum(s.num_samples for s in info.splits.values())
    print(
        f"{args.out_dir}: {total} images, {info.num_classes} classes, {info.num_categories} categories, "
        f"{len(info.skipped)} skipped"
    )
    return 0


def _register_train(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Same as `python -m dmltrain.run`: train on Ray, track in MLflow, resume on relaunch."
    )
    parser.add_argument("config", help="experiment YAML, e.g. configs/quickstart.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as train.steps=100")


def _run_train(args: argparse.Namespace) -> int:
    from dmltrain.service.run import main as run_main

    return run_main([args.config, *args.overrides])


def _register_evaluate(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Evaluate a trained model (the MLflow artifact model/model.pt) on a prepared data set with the data "
        "set's protocol, in this process (no Ray). Prints the metrics as JSON."
    )
    parser.add_argument("model", help="model.pt written by a dmltrain run")
    parser.add_argument("data_root", help="directory or URL with dataset.json and shards")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-images", type=int, default=None, help="cap per split for a quick look")


def _run_evaluate(args: argparse.Namespace) -> int:
    import json

    from dmltrain.service.evaluate_model import evaluate_saved_model

    try:
        metrics = evaluate_saved_model(args.model, args.data_root, args.batch_size, args.max_images)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dmltrain evaluate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


COMMANDS: dict[str, tuple[str, Register, Run]] = {
    "prepare": ("convert a data set into shards + dataset.json", _register_prepare, _run_prepare),
    "train": ("train on Ray with a config (python -m dmltrain.run)", _register_train, _run_train),
    "evaluate": ("evaluate a trained model on a prepared data set", _register_evaluate, _run_evaluate),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmltrain", description="Distributed large-batch metric learning.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, register, _) in COMMANDS.items():
        register(sub.add_parser(name, help=summary))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return COMMANDS[args.command][2](args)


if __name__ == "__main__":
    sys.exit(main())
