"""Checks the driver runs before any worker starts, so a mistake costs seconds and one line, not a Ray
worker group that fails (and is retried) on every rank.

Everything a worker would raise from its config or its data *layout* is raised here first: the model (a
backbone typo, weights that do not exist or do not fit, built on PyTorch's meta device so nothing is
allocated or downloaded), the sampler's batch plan against ``dataset.json`` (``dmltrain.data.check_batch``:
enough shards for every rank x loader worker, enough classes and categories to fill the global batch),
and optional packages the run will import.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from dmltrain.data import (
    BatchError,
    DatasetInfo,
    SamplerSpec,
    check_batch,
    damaged_shards,
    ensure_glyphs,
    load_dataset_info,
)
from dmltrain.data.metadata import METADATA_NAME
from dmltrain.data.urls import is_local, local_path
from dmltrain.models import MissingExtraError
from dmltrain.service.best import resolve_best_metric
from dmltrain.service.builders import check_network
from dmltrain.service.config import ConfigError, ExperimentConfig

log = logging.getLogger("dmltrain.service.preflight")

INSTALL_HINT = "pip install 'dmltrain[cpu]' (or 'dmltrain[gpu]' on CUDA machines; '.[cpu]' from a checkout)"


def check_config(config: ExperimentConfig) -> None:
    """What can be checked from the config alone (no data, no Ray); raises ConfigError naming the key."""
    try:
        # The whole network (any backbone kind, GeM, levels, a weights file matched against it) and its
        # preprocessing, on the meta device.
        check_network(config)
    except (ValueError, FileNotFoundError, MissingExtraError) as error:  # messages start with the key
        raise ConfigError(_one_line(error)) from None
    if config.eval.grid_queries > 0 and importlib.util.find_spec("faiss") is None:
        raise ConfigError(
            f"faiss is not installed, and eval.grid_queries={config.eval.grid_queries} needs it for the "
            f"retrieval plots: {INSTALL_HINT}, or set eval.grid_queries=0"
        )


def load_data(config: ExperimentConfig) -> DatasetInfo:
    """Build the embedded data set if asked, then read ``dataset.json``; a missing root is one line."""
    try:
        if config.data.prepare == "glyphs":
            if not (Path(config.data.root) / METADATA_NAME).is_file():
                log.info("data.prepare=glyphs: building the glyph set in %s (first use)", config.data.root)
            ensure_glyphs(config.data.root, progress=True)
        return load_dataset_info(config.data.root)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(f"data.root={config.data.root}: {_one_line(error)}") from None


def check_data(config: ExperimentConfig, info: DatasetInfo) -> None:
    """The training split, the evaluations and the sampler's plan for every rank, from dataset.json."""
    split = config.data.train_split
    if split not in info.splits:
        raise ConfigError(
            f"data.train_split: split {split!r} is not in {config.data.root}/dataset.json "
            f"(it has {sorted(info.splits)})"
        )
    if not info.evaluations:
        raise ConfigError(f"data.root={config.data.root}: dataset.json lists no evaluations to run")
    # Found here in a second, not by a worker after Ray started and the first evaluation ran; a remote
    # root (s3://, https://) is left to the loaders, which name the shard they cannot read.
    root = config.data.root
    damaged = (
        damaged_shards(info, local_path(root), [split, *info.evaluated_splits]) if is_local(root) else None
    )
    if damaged:
        raise ConfigError(
            f"data.root={root}: {damaged} (dataset.json lists them; prepare the data again, or copy the "
            f"shards whole)"
        )
    try:
        resolve_best_metric(config.train.best_metric, [e.name for e in info.evaluations], config.eval.ks)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    try:
        # Identical on every rank (workers build the same plan), so once here stands for all of them. A
        # batch the data cannot fill is one line that already names the keys, the numbers and the data.
        check_batch(
            info,
            split,
            SamplerSpec.from_config(config.sampler),
            config.train.global_batch_size,
            config.scaling.num_workers,
            config.data.loader_workers,
            where=config.data.root,
        )
    except BatchError as error:
        raise ConfigError(_one_line(error)) from None
    except (ValueError, KeyError) as error:
        raise ConfigError(
            f"sampler.name={config.sampler.name} on {config.data.root}: {_one_line(error)}"
        ) from None


def _one_line(error: BaseException) -> str:
    text = str(error).strip().strip("'\"")
    return " ".join(text.split())
