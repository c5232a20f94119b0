"""`dmltrain` console script (also `python -m dmltrain.service.cli`).

Each subcommand is a (register, run) pair in `COMMANDS`, so `train` / `evaluate` slot in beside `prepare`
without touching the others.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from dmltrain.versions import VersionAction

Register = Callable[[argparse.ArgumentParser], None]
Run = Callable[[argparse.Namespace], int]


def _integer(low: int, high: int | None = None, what: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]; ``what`` it must be, for the message."""
    what = what or f"an integer of at least {low}"

    def integer(text: str) -> int:  # argparse names the type in "invalid integer value: 'x'"
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
        return value

    return integer


_positive_int = _integer(1, what="a positive integer")
_non_negative_int = _integer(0, what="0 or more")
_port = _integer(1, 65535, "a TCP port, 1 to 65535")


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be a rate in [0, 1], got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _register_prepare(parser: argparse.ArgumentParser) -> None:
    from dmltrain.data.datasets import FORMATS

    parser.description = (
        "Convert a data set in its published layout into WebDataset shards plus dataset.json. "
        "Re-running is safe: an identical build with all its shards intact is left alone, a damaged one "
        "is rebuilt, an interrupted one resumes."
    )
    parser.add_argument("format", choices=FORMATS, help="source layout")
    parser.add_argument("source", help="source directory (CSV file for csv; '-' for glyphs)")
    parser.add_argument("out_dir", help="output directory for shards and dataset.json")
    parser.add_argument(
        "--shard-size", type=_positive_int, default=None, help="images per shard (default: ~64 shards)"
    )
    parser.add_argument(
        "--group-size", type=_positive_int, default=32, help="max images of a class stored together"
    )
    parser.add_argument(
        "--resize", type=_positive_int, default=None, help="re-encode with this shorter side (pixels)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed for shard layout and class splits")
    parser.add_argument(
        "--workers", type=_positive_int, default=1, help="processes writing shards, rendering glyphs"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if an identical build exists")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--test-fraction",
        type=_fraction,
        default=None,
        help="folder/csv/glyphs: share of classes held out for test (a layout without its own splits)",
    )
    parser.add_argument("--image-root", default=None, help="csv: folder the paths are relative to")
    parser.add_argument(
        "--split-dir", default=None, help="inaturalist: folder with the Smooth-AP split files"
    )
    parser.add_argument(
        "--min-faces", type=_integer(2), default=None, help="glyphs: faces a character needs (12)"
    )
    parser.add_argument(
        "--image-size", type=_integer(8), default=None, help="glyphs: image side in pixels (64)"
    )
    parser.add_argument(
        "--max-classes", type=_integer(2), default=None, help="glyphs: keep only the first N characters"
    )


def _run_prepare(args: argparse.Namespace) -> int:
    from dmltrain.data.conversion import prepare
    from dmltrain.data.datasets import SourceLayoutError
    from dmltrain.data.datasets.glyphs import DEFAULT_IMAGE_SIZE, DEFAULT_MIN_FACES

    options: dict[str, object] = {"test_fraction": args.test_fraction}
    if args.format == "csv":
        options["image_root"] = Path(args.image_root) if args.image_root else None
    if args.format == "inaturalist":
        options["split_dir"] = Path(args.split_dir) if args.split_dir else None
    if args.format == "glyphs":
        options["test_fraction"] = 0.5 if args.test_fraction is None else args.test_fraction
        options["min_faces"] = DEFAULT_MIN_FACES if args.min_faces is None else args.min_faces
        options["image_size"] = DEFAULT_IMAGE_SIZE if args.image_size is None else args.image_size
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
    except (SourceLayoutError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError) as exc:
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
    parser.add_argument("overrides", nargs="*", default=[], help="dotted overrides such as train.steps=100")


def _run_train(args: argparse.Namespace) -> int:
    from dmltrain.service.entry import main as run_main

    return run_main([args.config, *args.overrides])


def _register_sweep(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run every trial of a sweep file (a base config x dotted overrides) as one Ray Tune experiment, "
        "each through the same driver as `dmltrain train`, tracked as an MLflow parent run with a nested "
        "child run per trial; relaunching the same sweep continues it (finished trials are not re-run)."
    )
    parser.add_argument("sweep", help="sweep YAML, e.g. configs/sweeps/quality_losses.yaml")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        help="dotted overrides applied to every trial, e.g. train.steps=20",
    )
    parser.add_argument(
        "--name", default=None, help="sweep name (default: the file's); a new name means new runs"
    )
    parser.add_argument("--summary", default=None, help="also write the summary table (markdown) here")


def _run_sweep(args: argparse.Namespace) -> int:
    from dmltrain.service.config import ConfigError
    from dmltrain.service.errors import FatalRunError
    from dmltrain.service.logs import print_problems, setup_logging
    from dmltrain.service.sweeps import load_sweep, run_sweep

    setup_logging()
    summary = Path(args.summary) if args.summary else None
    if summary is not None and (summary.is_dir() or not summary.absolute().parent.is_dir()):
        # written after every trial has run: found now, not then (a traceback at the end)
        folder = summary.absolute().parent
        what = "is a folder" if summary.is_dir() else f"is in {folder}, which does not exist"
        print(f"error: --summary {summary} {what}", file=sys.stderr)
        return 2
    try:
        outcome = run_sweep(load_sweep(args.sweep, args.overrides, name=args.name))
    except (ConfigError, FatalRunError) as error:
        print_problems(error)
        return 2
    except KeyboardInterrupt:  # before Tune took over Ctrl-C (the baselines): as a stop inside Tune
        print("sweep stopped before its trials ran. The same command continues it.", file=sys.stderr)
        return 130
    print(outcome.summary)
    if summary is not None:
        summary.write_text(outcome.summary)
    where = f"MLflow parent run {outcome.parent_run_id} in {outcome.tracking_uri}"
    if outcome.unfinished:
        stopped = ", ".join(f"{label!r} ({status})" for label, status in outcome.unfinished.items())
        print(
            f"sweep stopped: {len(outcome.unfinished)} trial(s) did not finish: {stopped}; {where}. The same "
            "command continues it (finished trials are not trained again)."
        )
    else:
        print(f"sweep finished: {where}")
    for label, error in outcome.failed.items():
        print(f"error: trial {label!r} failed: {error}", file=sys.stderr)
    return 1 if outcome.failed else 130 if outcome.unfinished else 0


def _add_tracking_uri(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow store for runs:/ and models:/ (default: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db "
        "here)",
    )


_MODEL_HELP = "a model.pt or MLflow model folder, runs:/<run_id>/model, or models:/<name>/<version>"


def _add_decode_workers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workers",
        type=_non_negative_int,
        default=None,
        help="image decoding processes (default: none on a CPU, all cores but one on a GPU, at most 8)",
    )


def _register_evaluate(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Evaluate a trained model on a prepared data set with the data set's protocol, in this process (no "
        "Ray). Prints the metrics as JSON."
    )
    parser.add_argument("model", help=_MODEL_HELP)
    parser.add_argument("data_root", help="directory or URL with dataset.json and shards")
    parser.add_argument("--batch-size", type=_positive_int, default=128)
    parser.add_argument("--max-images", type=_integer(2), default=None, help="cap per split for a quick look")
    _add_decode_workers(parser)
    parser.add_argument(
        "--index",
        choices=["exact", "auto", "flat", "ivfpq", "hnsw"],
        default=None,
        help="exact ranking (default: the run's eval.index) or k-NN metrics from a faiss index of this kind",
    )
    _add_tracking_uri(parser)


def _run_evaluate(args: argparse.Namespace) -> int:
    import json

    from dmltrain.service.evaluate_model import evaluate_saved_model

    try:
        metrics = evaluate_saved_model(
            args.model,
            args.data_root,
            args.batch_size,
            args.max_images,
            tracking_uri=args.tracking_uri,
            index=args.index,
            workers=args.workers,
        )
    except (ValueError, OSError, KeyError) as exc:  # OSError: missing, unreadable, a folder for a file
        print(f"dmltrain evaluate: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


def _register_index(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Embed a prepared split with a trained model and store a faiss index of it with its id map "
        "(row -> shard, key, class). The kind follows the gallery size unless --kind says otherwise; a "
        "run's model also gets the index logged to its MLflow run."
    )
    parser.add_argument("model", help=_MODEL_HELP)
    parser.add_argument("data_root", help="directory or URL with dataset.json and shards")
    parser.add_argument(
        "--split", default=None, help="split to index (default: the first evaluation's gallery)"
    )
    parser.add_argument("--out", default=None, help="index directory (default: ./index_<dataset>_<split>)")
    parser.add_argument("--kind", choices=["auto", "flat", "ivfpq", "hnsw"], default="auto")
    parser.add_argument("--batch-size", type=_positive_int, default=128)
    _add_decode_workers(parser)
    parser.add_argument(
        "--no-log", action="store_true", help="do not log the index to the model's MLflow run"
    )
    parser.add_argument(
        "--no-search-model",
        action="store_true",
        help="log the index only, not also the search model (a copy of the index and the weights)",
    )
    parser.add_argument(
        "--register", default=None, metavar="NAME", help="register the search model as a new version of NAME"
    )
    _add_tracking_uri(parser)


def _run_index(args: argparse.Namespace) -> int:
    from dmltrain.service.serving.indexing import build_split_index

    try:
        target, meta = build_split_index(
            args.model,
            args.data_root,
            args.split,
            args.out,
            kind=args.kind,
            batch_size=args.batch_size,
            workers=args.workers,
            tracking_uri=args.tracking_uri,
            log_to_run=not args.no_log,
            search_model=not args.no_search_model,
            register_as=args.register,
        )
    except (ValueError, OSError, KeyError) as exc:  # OSError: missing, unreadable, a folder for a file
        print(f"dmltrain index: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{target}: {meta['ntotal']} images of {meta['dataset']}/{meta['split']}, {meta['description']}; "
        f"embedded in {meta['embed_seconds']:.1f} s, built in {meta['build_seconds']:.1f} s"
    )
    if "logged_to" in meta:
        print(f"logged to {meta['logged_to']}")
    if "search_model" in meta:
        print(
            f"search model: {meta['search_model']} (serve it: mlflow models serve -m {meta['search_model']} "
            "--env-manager local)"
        )
    if "registered" in meta:
        print(f"registered as {meta['registered']}")
    return 0


def _register_search(parser: argparse.ArgumentParser) -> None:
    parser.description = "Print the nearest indexed images of each query image (and optionally a grid PNG)."
    parser.add_argument(
        "index", help="index directory from `dmltrain index` (or runs:/<run_id>/indexes/<name>)"
    )
    parser.add_argument("images", nargs="+", help="query image files (JPEG, PNG, WebP)")
    parser.add_argument("-k", type=_positive_int, default=10, help="neighbours per query")
    parser.add_argument("--model", default=None, help="embed queries with this model instead of the index's")
    parser.add_argument("--grid", default=None, help="also write the queries and neighbours to this PNG")
    parser.add_argument(
        "--data-root", default=None, help="shards for --grid (default: the indexed data root)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_tracking_uri(parser)


def _run_search(args: argparse.Namespace) -> int:
    import json

    from dmltrain.service.serving.indexing import open_index, render_grid, search_images

    try:
        stored = open_index(args.index, args.tracking_uri)
        results, model = search_images(
            stored, args.images, args.k, model_ref=args.model, tracking_uri=args.tracking_uri
        )
        if args.grid:
            render_grid(stored, results, model, args.grid, args.data_root)
    except (ValueError, OSError, KeyError) as exc:  # OSError: missing, unreadable, a folder for a file
        print(f"dmltrain search: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{"query": r.query, "neighbours": r.neighbours} for r in results], indent=2))
        return 0
    for result in results:
        print(f"{result.query}")
        print("  rank  score   id      shard  key                              class")
        for rank, hit in enumerate(result.neighbours, 1):
            label = (
                f"{hit['class']} ({hit['class_name']})"
                if hit["class_name"] is not None
                else str(hit["class"])
            )
            print(
                f"  {rank:>4}  {hit['score']:.4f}  {hit['id']:<6}  {hit['shard']:>5}  {hit['key']:<32} "
                f"{label}"
            )
    if args.grid:
        print(f"grid: {args.grid}")
    return 0


def _register_serve(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve an index as a search service over HTTP: MLflow's model server on the index and its model "
        "(POST /invocations with images, one row per neighbour back; GET /ping). Stops on Ctrl-C or SIGTERM."
    )
    parser.add_argument(
        "index", help="index directory from `dmltrain index` (or runs:/<run_id>/indexes/<name>)"
    )
    parser.add_argument("--model", default=None, help="embed queries with this model instead of the index's")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (0.0.0.0: all)")
    parser.add_argument("--port", type=_port, default=5000)
    parser.add_argument("--workers", type=_positive_int, default=1, help="server processes")
    parser.add_argument(
        "--save",
        default=None,
        metavar="DIR",
        help="write the search model to this new folder (for mlflow models serve/build-docker) and exit",
    )
    _add_tracking_uri(parser)


def _run_serve(args: argparse.Namespace) -> int:
    from dmltrain.service.serving.serve import save_search_model, serve_index

    try:
        if args.save:
            if Path(args.save).exists():
                raise FileExistsError(f"{args.save} exists: give a new folder for the search model")
            meta = save_search_model(args.index, args.save, model=args.model, tracking_uri=args.tracking_uri)
            print(f"{args.save}: search model of {meta['ntotal']} images, {meta['dataset']}/{meta['split']}")
            return 0
        return serve_index(
            args.index,
            model=args.model,
            host=args.host,
            port=args.port,
            workers=args.workers,
            tracking_uri=args.tracking_uri,
        )
    except (ValueError, OSError, KeyError) as exc:
        print(f"dmltrain serve: error: {exc}", file=sys.stderr)
        return 2


def _register_verify(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "1:1 template verification (IJB-C style) of a trained model: template features are media-averaged "
        "image embeddings; prints TAR at each FAR as JSON. Template file: 'IMAGE TEMPLATE_ID [MEDIA_ID]' "
        "per line; pair file: 'TEMPLATE_ID TEMPLATE_ID 0|1' per line (IJB-C's own files as published)."
    )
    parser.add_argument("model", help=_MODEL_HELP)
    parser.add_argument("templates", help="template file, e.g. ijbc_face_tid_mid.txt")
    parser.add_argument("pairs", help="pair file, e.g. ijbc_template_pair_label.txt")
    parser.add_argument("--image-root", required=True, help="folder the template file's image paths are in")
    parser.add_argument("--far", type=_rate, nargs="+", default=[1e-3, 1e-4], help="false accept rates")
    parser.add_argument("--batch-size", type=_positive_int, default=128)
    _add_tracking_uri(parser)


def _run_verify(args: argparse.Namespace) -> int:
    import json

    from dmltrain.service.verify import verify_saved_model

    try:
        metrics = verify_saved_model(
            args.model,
            args.templates,
            args.pairs,
            args.image_root,
            args.batch_size,
            args.far,
            tracking_uri=args.tracking_uri,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"dmltrain verify: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(metrics, indent=2, sort_keys=True))
    return 0


COMMANDS: dict[str, tuple[str, Register, Run]] = {
    "prepare": ("convert a data set into shards + dataset.json", _register_prepare, _run_prepare),
    "train": ("train on Ray with a config (python -m dmltrain.run)", _register_train, _run_train),
    "sweep": ("run a grid of trials through Ray Tune, one MLflow parent run", _register_sweep, _run_sweep),
    "evaluate": ("evaluate a trained model on a prepared data set", _register_evaluate, _run_evaluate),
    "index": ("build a faiss index of a prepared split with a trained model", _register_index, _run_index),
    "search": ("nearest indexed images of query images", _register_search, _run_search),
    "serve": ("serve an index as a search service over HTTP", _register_serve, _run_serve),
    "verify": ("1:1 template verification (TAR at FAR) of a trained model", _register_verify, _run_verify),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dmltrain", description="Distributed large-batch metric learning.")
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, register, _) in COMMANDS.items():
        register(sub.add_parser(name, help=summary))
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, with dotted overrides accepted before or after options: argparse stops filling
    a positional list at the first option, so in ``dmltrain sweep FILE --name x train.steps=40`` the
    override would otherwise be refused as unrecognised."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return COMMANDS[args.command][2](args)


def console() -> None:
    """The `dmltrain` script: `main`, then the exit a stopped `dmltrain train` needs
    (`dmltrain.service.entry.exit_process`)."""
    from dmltrain.service.entry import exit_process

    exit_process(main())


if __name__ == "__main__":
    console()
