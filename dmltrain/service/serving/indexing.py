"""`dmltrain index` and `dmltrain search`: embed a prepared split into a stored faiss index; search it.

An index directory holds ``index.faiss``, ``ids.npz`` (row -> shard, key, class) and ``index.json`` (the
index spec with every parameter, the model reference, data root, split, class names, build time). When the
model is a run's (``runs:/`` or a registered version with a run) the directory is also logged to that run
as ``indexes/<dataset>_<split>``, and with its model as the search pyfunc ``search_<dataset>_<split>``
(`search_model`), which ``mlflow models serve`` serves.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dmltrain.data import EvalLoader, load_dataset_info
from dmltrain.data.shards import read_shard
from dmltrain.data.urls import is_local, local_path
from dmltrain.index import (
    INDEX_FILE,
    INDEX_FILES,
    META_FILE,
    IdMap,
    StoredIndex,
    build_index,
    choose_spec,
    load_index,
    save_index,
)
from dmltrain.inference import embed_batch, embed_images, image_tensor
from dmltrain.service.serving.loading import (
    LoadedModel,
    default_decode_workers,
    downloaded,
    is_mlflow_uri,
    load_embedding_model,
    located,
    model_from_weights,
)

log = logging.getLogger("dmltrain.service.serving.indexing")


def default_split(info: Any) -> str:
    """The gallery of the data set's first evaluation (its query split for leave-one-out)."""
    first = info.evaluations[0]
    return first.gallery or first.query


@dataclass
class SplitEmbeddings:
    embeddings: np.ndarray
    ids: IdMap


@torch.no_grad()
def embed_split(
    model: LoadedModel, data_root: str, split: str, batch_size: int, workers: int
) -> SplitEmbeddings:
    """Every image of ``split`` through the model's test-time path, with its (shard, key, class)."""
    info = load_dataset_info(data_root)
    loader = EvalLoader(
        data_root,
        split,
        batch_size,
        rank=0,
        world_size=1,
        num_workers=workers,
        transform=model.transform,
        info=info,
        with_shards=True,
    )
    normalize = model.preprocessing.normalizer()
    chunks, shards, keys, labels = [], [], [], []
    for images, batch_labels, _categories, batch_keys, batch_shards in loader:
        chunks.append(embed_batch(model.net, images, model.device, None, normalize).cpu().numpy())
        labels.append(batch_labels.numpy())
        keys += batch_keys
        shards += batch_shards
    if not chunks:
        raise ValueError(f"split {split!r} of {data_root} has no images")
    return SplitEmbeddings(np.concatenate(chunks), IdMap(shards, keys, np.concatenate(labels)))


def _absolute(root: str) -> str:
    return str(Path(local_path(root)).resolve()) if is_local(root) else root


def build_split_index(
    model_ref: str,
    data_root: str,
    split: str | None = None,
    out: str | Path | None = None,
    *,
    kind: str = "auto",
    batch_size: int = 128,
    workers: int | None = None,
    tracking_uri: str | None = None,
    log_to_run: bool = True,
    search_model: bool = True,
    register_as: str | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Embed ``split`` of ``data_root`` with the model, build the index ``kind`` (auto: by size), store it
    in ``out`` (default ``./index_<dataset>_<split>``), decoding in ``workers`` loader processes (default:
    `default_decode_workers`); log it to the model's run when there is one, and
    (``search_model``) the search pyfunc of the index and the model beside it, registered as a new version
    of ``register_as`` if given."""
    if register_as and not (log_to_run and search_model and is_mlflow_uri(model_ref)):
        raise ValueError(
            "registering the search model needs it logged to the model's run: a runs:/ or models:/ model, "
            "without --no-log or --no-search-model"
        )
    with located(model_ref, tracking_uri) as (weights, run_id):  # one download for embedding and logging
        model = model_from_weights(weights, model_ref, run_id)
        info = load_dataset_info(data_root)
        split = split or default_split(info)
        info.split(split)  # a missing split is an error that lists the splits
        name = f"{info.name}_{split}"
        target = Path(out) if out is not None else Path.cwd() / f"index_{name}"
        check_index_target(target)  # before the minutes of embedding, not after
        started = time.perf_counter()
        if workers is None:
            workers = default_decode_workers(model, batch_size)
        embedded = embed_split(model, data_root, split, batch_size, workers)
        embed_seconds = time.perf_counter() - started
        spec = choose_spec(*embedded.embeddings.shape, kind)  # type: ignore[arg-type]
        built = build_index(embedded.embeddings, spec)
        present = sorted({int(c) for c in embedded.ids.label})
        meta = {
            "model": model.source,
            "run_id": model.run_id,
            "model_step": model.step,
            "model_sha256": model.digest,
            "data_root": _absolute(data_root),
            "dataset": info.name,
            "split": split,
            "class_names": {str(c): info.class_names[c] for c in present if 0 <= c < len(info.class_names)},
            "embed_seconds": round(embed_seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        save_index(target, built, embedded.ids, meta)
        if log_to_run and model.run_id and is_mlflow_uri(model_ref):
            from mlflow.tracking import MlflowClient

            from dmltrain.service.tracking import resolve_tracking_uri

            tracking = resolve_tracking_uri(tracking_uri)
            client = MlflowClient(tracking)
            for file in INDEX_FILES:  # the index's own files, whatever else the folder holds
                client.log_artifact(model.run_id, str(target / file), f"indexes/{name}")
            meta["logged_to"] = f"runs:/{model.run_id}/indexes/{name}"
            if search_model:
                logged = log_search_model(
                    tracking, model.run_id, f"search_{name}", weights, target, step=model.step or 0
                )
                meta["search_model"] = f"runs:/{model.run_id}/search_{name}"
                if register_as:
                    from dmltrain.service.serving.publish import register

                    meta["registered"] = register(
                        tracking, model.run_id, register_as, f"search_{name}", logged.model_uri
                    )
        meta.update(
            {"ntotal": built.ntotal, "description": spec.describe(), "build_seconds": built.build_seconds}
        )
        return target, meta


def check_index_target(target: Path) -> None:
    """``dmltrain index --out``: a new or empty folder, or an index directory to rebuild; anything else is
    refused. A folder's other files would be replaced or, logged to the run, uploaded with the index
    (``--out .`` beside the default store's ``mlruns/`` copied the store into itself)."""
    if not target.exists():
        return
    if not target.is_dir():
        raise FileExistsError(f"--out {target}: exists and is not a folder")
    entries = list(target.iterdir())
    if entries and not ((target / META_FILE).is_file() and (target / INDEX_FILE).is_file()):
        shown = ", ".join(sorted(p.name for p in entries)[:5])
        raise FileExistsError(
            f"--out {target}: a folder with other files ({shown}{' ...' if len(entries) > 5 else ''}); "
            "give a new or empty folder, or an index directory to rebuild"
        )


def check_built_with(meta: dict[str, Any], step: int | None, source: str, digest: str | None = None) -> None:
    """The index's own model must still be the one it was built with: ``runs:/<id>/model`` names the run's
    newest model (a relaunch that trained further logs a new one) and a file can be replaced, and queries
    embedded by another model than the gallery's find the wrong neighbours with nothing to show for it.
    ``digest`` (`weights_digest`) tells apart files of the same step; indexes built before it recorded
    one are checked by step only."""
    built = meta.get("model_step")
    if built is not None and step is not None and int(built) != int(step):
        raise ValueError(
            f"the index was built with the step-{built} model of {meta.get('model')}, but {source} is now "
            f"the step-{step} one (trained further, or replaced): rebuild the index with `dmltrain index`, "
            "or give --model the model it was built with"
        )
    built_digest = meta.get("model_sha256")
    if built_digest and digest and built_digest != digest:
        raise ValueError(
            f"the index was built with the model of {meta.get('model')} whose weights have sha256 "
            f"{built_digest[:12]}..., but {source} is now another file ({digest[:12]}..., replaced or "
            "retrained to the same step): rebuild the index with `dmltrain index`, or give --model the "
            "model it was built with"
        )


def log_search_model(
    tracking: str, run_id: str, name: str, weights: Path, index_dir: Path, *, step: int
) -> Any:
    """Log the index with its model's weights file as the search pyfunc ``name`` of ``run_id``
    (`search_model`), so ``mlflow models serve -m runs:/<run_id>/<name>`` serves it; returns MLflow's
    ModelInfo."""
    from dmltrain.service.serving.pyfunc import log_pyfunc
    from dmltrain.service.serving.search_model import index_files_only, search_parts

    with index_files_only(index_dir) as files:
        return log_pyfunc(tracking, run_id, name, search_parts(weights, files), step=step)


@contextlib.contextmanager
def index_directory(ref: str | Path, tracking_uri: str | None = None) -> Iterator[Path]:
    """The folder of an index reference: a local index directory as given, or one logged to MLflow
    (``runs:/<run_id>/indexes/<name>``) downloaded for the block and removed after it."""
    text = str(ref)
    if is_mlflow_uri(text):
        with downloaded(text, tracking_uri) as local:
            yield local
        return
    yield Path(text).expanduser()


def open_index(ref: str | Path, tracking_uri: str | None = None) -> StoredIndex:
    """A local index directory, or one logged to MLflow, read into memory (a downloaded copy goes at once)."""
    with index_directory(ref, tracking_uri) as directory:
        return load_index(directory)


@dataclass
class SearchResult:
    query: str
    neighbours: list[dict[str, Any]]  # id, score, shard, key, class, class_name; best first


def search_images(
    stored: StoredIndex,
    images: list[str | Path],
    k: int = 10,
    *,
    model_ref: str | None = None,
    tracking_uri: str | None = None,
) -> tuple[list[SearchResult], LoadedModel]:
    """Embed image files with the index's model (or ``model_ref``) and return their ``k`` nearest rows."""
    data = []
    for path in images:
        file = Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"image not found: {file}")
        data.append(file.read_bytes())
    model = load_embedding_model(model_ref or stored.meta["model"], tracking_uri)
    if model_ref is None:
        check_built_with(stored.meta, model.step, stored.meta["model"], model.digest)
    embeddings = embed_images(
        model.net,
        data,
        model.transform,
        model.device,
        normalize=model.preprocessing.normalizer(),
        names=[str(path) for path in images],
    )
    found = stored.neighbours(embeddings, k)
    return [SearchResult(str(path), hits) for path, hits in zip(images, found, strict=True)], model


def render_grid(
    stored: StoredIndex,
    results: list[SearchResult],
    model: LoadedModel,
    out: str | Path,
    data_root: str | None = None,
) -> Path:
    """Queries and their neighbours as a PNG (plots.retrieval_grid); gallery images are read back from the
    shards the id map names. A neighbour of the top hit's class is bordered green, others red."""
    from dmltrain.plots import retrieval_grid

    root = data_root or stored.meta["data_root"]
    info = load_dataset_info(root)
    mismatch = (
        f"--data-root {root} is not the data the index was built from ({stored.meta.get('data_root')}, "
        f"{stored.meta.get('dataset')}/{stored.meta['split']})"
    )
    if info.name != stored.meta.get("dataset", info.name) or stored.meta["split"] not in info.splits:
        raise ValueError(mismatch)
    urls = info.shard_urls(root, stored.meta["split"])
    wanted: dict[int, set[str]] = {}
    for result in results:
        for hit in result.neighbours:
            wanted.setdefault(hit["shard"], set()).add(hit["key"])
    if max(wanted, default=-1) >= len(urls):
        raise ValueError(mismatch)
    pictures: dict[tuple[int, str], np.ndarray] = {}
    for shard, keys in wanted.items():
        for sample in read_shard(urls[shard], shard=shard):
            if sample.key in keys:
                pictures[(shard, sample.key)] = (
                    model.transform(image_tensor(sample.data)).permute(1, 2, 0).numpy()
                )
    absent = [
        f"{key} (shard {shard})"
        for shard, keys in wanted.items()
        for key in keys
        if (shard, key) not in pictures
    ]
    if absent:
        raise ValueError(f"{mismatch}: {len(absent)} neighbour(s) not in its shards, e.g. {absent[0]}")
    k = max((len(r.neighbours) for r in results), default=0)
    neighbours = np.full((len(results), max(k, 1)), -1, dtype=np.int64)
    gallery: dict[int, np.ndarray] = {}
    gallery_labels: list[int] = []
    query_labels = []
    for row, result in enumerate(results):
        for col, hit in enumerate(result.neighbours):
            neighbours[row, col] = len(gallery_labels)
            gallery[len(gallery_labels)] = pictures[(hit["shard"], hit["key"])]
            gallery_labels.append(hit["class"])
        query_labels.append(result.neighbours[0]["class"] if result.neighbours else -1)
    queries = [
        model.transform(image_tensor(Path(r.query).read_bytes(), r.query)).permute(1, 2, 0).numpy()
        for r in results
    ]
    size = queries[0].shape[0]
    retrieval_grid(
        queries,
        np.asarray(query_labels),
        neighbours,
        gallery,
        np.asarray(gallery_labels),
        scale=max(1, 96 // max(size, 1)),
        path=out,
    )
    return Path(out)
