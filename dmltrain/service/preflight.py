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
import math
import os
import socket
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from dmltrain.data import (
    BatchError,
    DatasetInfo,
    SamplerSpec,
    check_batch,
    damaged_shards,
    ensure_glyphs,
    load_dataset_info,
)
from dmltrain.data.metadata import METADATA_NAME, evaluation_problem
from dmltrain.data.plan import TrainPlan
from dmltrain.data.shared_memory import (
    encoded_bytes_per_image,
    eval_loader_bytes,
    shared_memory_problem,
    train_loader_bytes,
)
from dmltrain.data.urls import is_local, local_path
from dmltrain.models import MissingExtraError
from dmltrain.service.best import resolve_best_metric
from dmltrain.service.builders import check_network, resolve_preprocessing
from dmltrain.service.config import ConfigError, ExperimentConfig, recall_ks
from dmltrain.service.distributed_eval import index_kind
from dmltrain.service.tracking import sqlite_store_path

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
    except TypeError as error:  # a keyword the backbone's constructor does not take
        if not config.model.backbone_kwargs:
            raise
        raise ConfigError(
            f"model.backbone_kwargs={config.model.backbone_kwargs}: {_one_line(error)}"
        ) from None
    if config.eval.grid_queries > 0 and importlib.util.find_spec("faiss") is None:
        raise ConfigError(
            f"faiss is not installed, and eval.grid_queries={config.eval.grid_queries} needs it for the "
            f"retrieval plots: {INSTALL_HINT}, or set eval.grid_queries=0"
        )


def load_data(config: ExperimentConfig) -> DatasetInfo:
    """Build the embedded data set if asked, then read ``dataset.json``; a missing root is one line."""
    try:
        if config.data.prepare == "glyphs":
            folder = local_path(config.data.root)  # file:///x is /x (it built into ./file:/x)
            if not (Path(folder) / METADATA_NAME).is_file():
                log.info("data.prepare=glyphs: building the glyph set in %s (first use)", folder)
            ensure_glyphs(folder, progress=True)
        return load_dataset_info(config.data.root)
    except (FileNotFoundError, ValueError, OSError) as error:
        raise ConfigError(f"data.root={config.data.root}: {_one_line(error)}") from None
    except Exception as error:  # a remote store's own errors (missing credentials, an unknown bucket)
        raise ConfigError(
            f"data.root={config.data.root}: cannot read {METADATA_NAME} ({type(error).__name__}: "
            f"{_one_line(error)})"
        ) from None


def check_data(config: ExperimentConfig, info: DatasetInfo) -> TrainPlan:
    """The training split, the evaluations and the sampler's plan for every rank, from dataset.json; returns
    that plan."""
    split = config.data.train_split
    if split not in info.splits:
        raise ConfigError(
            f"data.train_split: split {split!r} is not in {config.data.root}/dataset.json "
            f"(it has {sorted(info.splits)})"
        )
    if not info.evaluations:
        raise ConfigError(f"data.root={config.data.root}: dataset.json lists no evaluations to run")
    for evaluation in info.evaluations:
        problem = evaluation_problem(info, evaluation)
        if problem:
            raise ConfigError(f"data.root={config.data.root}: {problem}")
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
        names = [e.name for e in info.evaluations]
        best = resolve_best_metric(config.train.best_metric, names, recall_ks(config, info.recall_ks))
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _check_best_metric_is_reported(config, info, best)
    try:
        # Identical on every rank (workers build the same plan), so once here stands for all of them. A
        # batch the data cannot fill is one line that already names the keys, the numbers and the data.
        return check_batch(
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


def short_pieces_note(config: ExperimentConfig, plan: TrainPlan) -> str | None:
    """One line for the start of a `pk` run whose batch parts (``plan``, from `check_data`) are not
    multiples of K, else None.

    Each loader worker's part of a step is filled with pieces of at most K images of a class; a part that
    is not a multiple of K ends with a shorter piece, so some classes enter every batch with fewer than K
    images. It is legal (a class needs two), but not what sampler.samples_per_class asked for.
    """
    k = config.sampler.samples_per_class
    parts = plan.parts or []
    largest = max((n for held in plan.holdings for n in held.runs.values()), default=0)
    if config.sampler.name == "pk" and 2 <= largest < k:
        return (
            f"sampler.samples_per_class={k}, but no train class has more than {largest} images in one shard: "
            f"every class enters a batch whole, with fewer than {k} images"
        )
    if config.sampler.name != "pk" or all(p % k == 0 for p in parts):
        return None
    workers = config.scaling.num_workers
    sizes = " and ".join(str(p) for p in sorted(set(parts)))
    return (
        f"sampler.samples_per_class={k}: train.global_batch_size={config.train.global_batch_size} is read in "
        f"parts of {sizes} images (scaling.num_workers={workers} x "
        f"data.loader_workers={config.data.loader_workers}), not all multiples of {k}, so some classes enter "
        f"each batch with fewer than {k} images; a global batch that is a multiple of {k * workers} avoids it"
    )


def evaluated_train_split_note(config: ExperimentConfig, info: DatasetInfo) -> str | None:
    """One line for the start of a run that trains on a split one of its evaluations reads, else None.

    Retrieval benchmarks test on classes never trained on; metrics of a trained-on split measure how well
    the model fits its training data instead, which a user who set ``data.train_split=test`` by mistake (or
    for a quick check) should hear before reading them as held-out figures.
    """
    split = config.data.train_split
    names = [e.name for e in info.evaluations if split in (e.query, e.gallery)]
    if not names:
        return None
    return (
        f"data.train_split={split} is also read by evaluation(s) {', '.join(names)}: their metrics measure "
        "images the model trains on, not held-out ones"
    )


# Tracking stores reached over the network, by scheme (SQLAlchemy's "postgresql+psycopg2" counts as
# "postgresql"), with the port a URI without one means.
_DEFAULT_PORTS = {
    "http": 80,
    "https": 443,
    "postgresql": 5432,
    "postgres": 5432,
    "mysql": 3306,
    "mssql": 1433,
}


def expected_decode(config: ExperimentConfig) -> str:
    """The decode path the workers of a single-node run will take (the driver's node is theirs):
    ``data.decode=auto`` decodes on the GPU where the node has one the run uses."""
    if config.data.decode != "auto":
        return config.data.decode
    import torch

    return "gpu" if config.scaling.use_gpu is not False and torch.cuda.is_available() else "cpu"


def shared_memory_config_need(
    config: ExperimentConfig, info: DatasetInfo, decode: str, ranks: int
) -> tuple[int, str]:
    """About what the loaders of `ranks` ranks on one node keep in shared memory at most, and the keys
    behind it for a message. Each rank's training loader keeps its buffers for the run, and an
    evaluation's loader works beside them (`dmltrain.data.shared_memory`)."""
    data = config.data
    side = resolve_preprocessing(config).resolution
    per_rank = train_loader_bytes(
        config.local_batch_size,
        data.loader_workers,
        side,
        decode="gpu" if decode == "gpu" else "cpu",
        host_decode_share=data.host_decode_share,
        encoded_bytes_per_image=encoded_bytes_per_image(info, data.train_split),
    )
    # An evaluation's loader starts no more workers than a rank has shards of the split.
    shards = max((len(info.split(s).shards) for s in info.evaluated_splits), default=0)
    eval_workers = min(data.loader_workers, math.ceil(shards / config.scaling.num_workers))
    per_rank += eval_loader_bytes(config.eval.batch_size, eval_workers, side)
    what = (
        f"the loaders of {ranks} rank(s) ({config.local_batch_size} images a rank at {side} px: "
        f"train.global_batch_size={config.train.global_batch_size} over "
        f"scaling.num_workers={config.scaling.num_workers}; data.loader_workers={data.loader_workers}, "
        f"data.decode={decode}, eval.batch_size={config.eval.batch_size})"
    )
    return per_rank * ranks, what


def shared_memory_config_problem(
    config: ExperimentConfig, info: DatasetInfo, decode: str, ranks: int
) -> str | None:
    """One line naming the keys when the loaders of `ranks` ranks on one node would keep more in shared
    memory than the node's /dev/shm holds, else None."""
    return shared_memory_problem(*shared_memory_config_need(config, info, decode, ranks))


# The URI schemes pyarrow.fs.FileSystem.from_uri (Ray Train's storage) resolves, as it spells them (it is
# case-sensitive), plus any fsspec+<protocol>://: listed, since resolving an s3:// URI itself asks the
# network for the bucket's region.
_STORAGE_SCHEMES = frozenset(
    {"file", "local", "mock", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss", "hf"}
)


def check_outputs(config: ExperimentConfig, tracking_uri: str, timeout_s: float = 5.0) -> None:
    """Where the run writes: the MLflow store and ``run.storage_path`` (resolved), checked in seconds.

    Without this, a tracking server that is down cost about 4 minutes of MLflow's retries and then a
    traceback, and a storage path that is a file or on a read-only mount failed inside Ray's controller
    after Ray had started and an MLflow run had been created.
    """
    problems = []
    tracking = tracking_problem(tracking_uri, timeout_s)
    if tracking:
        problems.append(f"mlflow.tracking_uri={tracking_uri}: {tracking}")
    storage = config.run.storage_path
    if "://" not in storage:  # s3:// and other remote storage is Ray's (pyarrow's) to reach
        problem = directory_problem(Path(storage))
        if problem:
            problems.append(f"run.storage_path={storage}: {problem}")
    else:
        # Ray's controller died on another scheme, after an MLflow run had been created
        scheme = storage.split("://", 1)[0]
        if scheme not in _STORAGE_SCHEMES and not scheme.startswith("fsspec+"):
            problems.append(
                f"run.storage_path={storage}: Ray stores checkpoints through pyarrow, which has no file "
                f"system for {scheme}:// (it has {', '.join(f'{s}://' for s in sorted(_STORAGE_SCHEMES))} "
                "and fsspec+<protocol>://, in lower case)"
            )
    if problems:
        raise ConfigError("\n".join(problems))


def tracking_problem(uri: str, timeout_s: float = 5.0) -> str | None:
    """Why the MLflow store at ``uri`` cannot be used, or None: a scheme MLflow has no store for, a sqlite
    file whose folder cannot be written, or a server (http, a database) that refuses or does not answer a
    connection."""
    unknown = _store_problem(uri)
    if unknown:
        return unknown
    store = sqlite_store_path(uri)
    if store is not None:
        folder = store.expanduser().absolute().parent
        problem = directory_problem(folder)
        return f"{folder} {problem}" if problem and problem.startswith("is a file") else problem
    parts = urlsplit(uri)
    scheme = parts.scheme.split("+")[0].lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None  # file:, databricks, a plugin's store: MLflow's own errors say more
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError as error:
        return f"invalid port ({error})"
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as error:
        reason = error.strerror or str(error) or type(error).__name__
        return f"cannot connect to {parts.hostname}:{port} ({reason})"
    return _mlflow_server_problem(uri, timeout_s) if scheme in ("http", "https") else None


def _store_problem(uri: str) -> str | None:
    """Why MLflow would refuse the tracking store at ``uri`` on first use, or None. A scheme no store (its
    own or a plugin's) takes failed with a traceback about its model registry, and a path or file: URI
    names the file store MLflow 3 refuses unless MLFLOW_ALLOW_FILE_STORE is set (42 lines of traceback),
    both when the driver first looked the run up."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry
    except ImportError:  # another MLflow layout: its own error will have to say it
        return None
    try:
        builder = registry.get_store_builder(uri)
    except Exception:
        known = ", ".join(sorted(f"{scheme}:" for scheme in getattr(registry, "_registry", {}) if scheme))
        scheme = urlsplit(uri).scheme
        return f"MLflow has no tracking store for {scheme}: URIs (it has {known}, and paths)"
    if builder is not registry.get_store_builder("file:///mlruns"):  # "databricks" has no scheme either
        return None
    try:
        if MLFLOW_ALLOW_FILE_STORE.get():
            return None
    except ValueError as error:  # MLflow reads only true/false/1/0
        return f"MLFLOW_ALLOW_FILE_STORE: {error}"
    return (
        "a file store, which this MLflow refuses unless MLFLOW_ALLOW_FILE_STORE=true: use "
        "sqlite:///<folder>/mlflow.db, a tracking server, or set that variable"
    )


def _mlflow_server_problem(uri: str, timeout_s: float) -> str | None:
    """One request of MLflow's REST API, with the client's own credentials (MLFLOW_TRACKING_TOKEN, ...):
    something else listening on that port, or credentials the server refuses, show here."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(
            get_default_host_creds(uri),
            "/api/2.0/mlflow/experiments/search",
            "POST",
            max_retries=0,
            timeout=timeout_s,
            json={"max_results": 1},
        )
    except Exception as error:  # requests' and MLflow's own errors alike: the first line says why
        return f"no MLflow server answers there ({_one_line(error)[:200]})"
    if response.status_code in (401, 403):
        return (
            f"the server refused the credentials (HTTP {response.status_code}): set MLFLOW_TRACKING_USERNAME "
            "and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
        )
    if response.status_code != 200:
        return f"no MLflow server answers there (HTTP {response.status_code} from its REST API)"
    return None


def directory_problem(path: Path) -> str | None:
    """Why files cannot be written in the folder ``path`` (created on demand), or None. A real write of a
    probe file, in the folder or its nearest existing parent: permissions, a read-only mount and a full
    quota all show, where os.access would miss some."""
    path = path.expanduser().absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return "is a file, not a directory" if existing == path else f"{existing} is a file"
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".dmltrain-write-check-")
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        where = "" if existing == path else f" (in {existing}, where it would be created)"
        return f"cannot write there{where}: {error.strerror or error}"
    return None


def _check_best_metric_is_reported(config: ExperimentConfig, info: DatasetInfo, best: str | None) -> None:
    """Full-ranking mAP comes from the exact evaluation only: one scored by a faiss index (eval.index, or
    a gallery past eval.exact_max_gallery) reports recall@K, map@r and r_precision, and a run ranking by
    map stopped at its first evaluation."""
    for evaluation in info.evaluations:
        if best != f"eval/{evaluation.name}/map":
            continue
        gallery = info.split(evaluation.gallery or evaluation.query).num_samples
        if config.eval.max_images is not None:  # the evaluation embeds at most this many per split
            gallery = min(gallery, config.eval.max_images)
        kind = index_kind(config, gallery)
        if kind != "exact":
            why = (
                f"eval.index={kind}"
                if config.eval.index != "auto"
                else f"its gallery of {gallery:,} images is past eval.exact_max_gallery="
                f"{config.eval.exact_max_gallery:,}"
            )
            raise ConfigError(
                f"train.best_metric={best}: evaluation {evaluation.name!r} is scored by a faiss index "
                f"({why}), which reports recall@K, map@r and r_precision, not map"
            )


def _one_line(error: BaseException) -> str:
    """The error's message on one line; KeyError's repr quotes are taken off (others' quotes are text)."""
    text = str(error).strip()
    if isinstance(error, KeyError) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        text = text[1:-1]
    return " ".join(text.split())
