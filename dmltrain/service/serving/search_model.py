"""A faiss index with its model as one MLflow pyfunc: images in, their nearest indexed images out.

What people train embeddings for is search, and MLflow already serves pyfuncs (``mlflow models serve``,
``build-docker``, the registry, the UI). So a search service is this model: the embedding model's weights
and the index directory (``index.faiss``, ``ids.npz``, ``index.json``) as artifacts, the same test-time
path as :class:`.pyfunc.EmbeddingModel`, then the index. Input: the embedding model's (an ``image`` column
of encoded bytes, base64 over REST, or uint8 arrays). Params: ``k`` (default 10) and ``batch_size``.
Output: one row per (query, neighbour), best first: ``query`` (the input row), ``rank`` (1 = nearest),
``score`` (inner product of unit vectors), ``id`` (index row), ``shard``, ``key``, ``class``,
``class_name``; the same neighbours ``dmltrain search`` prints.

``dmltrain index`` logs it to the model's run as ``search_<dataset>_<split>``; ``dmltrain serve`` builds
one from any index directory and serves it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from dmltrain.index import INDEX_FILES, StoredIndex, load_index
from dmltrain.service.serving.pyfunc import (
    MAX_K,
    EmbeddingModel,
    PyfuncParts,
    embedding_parts,
    request_param,
)

INDEX_ARTIFACT = "index"
COLUMNS = ("query", "rank", "score", "id", "shard", "key", "class", "class_name")
_SEARCH_CODE = Path(__file__).with_name("_search_code.py")
_FAISS_DISTRIBUTIONS = ("faiss-cpu", "faiss-gpu-cu12", "faiss-gpu-cu11", "faiss-gpu")


class SearchModel(EmbeddingModel):
    """The embedding model plus its index: predicts the neighbours of each input image."""

    def load_context(self, context: Any) -> None:
        super().load_context(context)
        self.index = load_index(context.artifacts[INDEX_ARTIFACT])
        if self.index.index.dim != self.net.output_dim:
            raise ValueError(
                f"the index holds {self.index.index.dim}-d embeddings but the model makes "
                f"{self.net.output_dim}-d ones"
            )

    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        k = request_param(params, "k", 10, MAX_K)  # before the images are embedded
        return neighbours_frame(self.index, super().predict(context, model_input, params), k)


def neighbours_frame(stored: StoredIndex, embeddings: np.ndarray, k: int) -> Any:
    """`StoredIndex.neighbours` as a long table, one row per (query, neighbour)."""
    import pandas as pd

    rows = [
        {"query": query, "rank": rank, **hit}
        for query, hits in enumerate(stored.neighbours(embeddings, k))
        for rank, hit in enumerate(hits, 1)
    ]
    frame = pd.DataFrame(rows, columns=list(COLUMNS))
    return frame.astype(dict.fromkeys(("query", "rank", "id", "shard", "class"), "int64"))


def search_signature(params: Any) -> Any:
    """The embedding model's input and params, plus ``k``; the long table as output."""
    from mlflow.models import ModelSignature
    from mlflow.types import DataType
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    types = {"score": DataType.double, "key": DataType.string, "class_name": DataType.string}
    outputs = Schema(
        [ColSpec(types.get(name, DataType.long), name, required=name != "class_name") for name in COLUMNS]
    )
    return ModelSignature(
        inputs=params.inputs,
        outputs=outputs,
        params=ParamSchema([*params.params.params, ParamSpec("k", DataType.long, 10)]),
    )


def _faiss_requirement() -> str:
    """faiss for the served model's environment: the installed faiss-cpu as it is; a GPU build as faiss-cpu
    of the same release (``~=`` 1.11.0: any 1.11.x), which installs on any host, as torch's pin leaves out
    its CUDA tag. A GPU host swaps it for faiss-gpu as at install (README, Set up)."""
    for name in _FAISS_DISTRIBUTIONS:
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if name == "faiss-cpu":
            return f"faiss-cpu=={version}"
        return "faiss-cpu~=" + ".".join(version.split("+", 1)[0].split(".")[:3])
    return "faiss-cpu"


@contextlib.contextmanager
def index_files_only(index_dir: Path) -> Iterator[Path]:
    """The index directory as the search model's artifact: itself when it holds only the index's files,
    else a temporary folder with just those (an artifact is the whole folder, other files and all)."""
    if {p.name for p in index_dir.iterdir()} <= set(INDEX_FILES):
        yield index_dir
        return
    with tempfile.TemporaryDirectory(prefix="dmltrain-index-") as tmp:
        for name in INDEX_FILES:
            shutil.copy2(index_dir / name, Path(tmp) / name)
        yield Path(tmp)


def search_parts(weights_file: str | Path, index_dir: str | Path) -> PyfuncParts:
    """The search pyfunc of a weights file and an index directory built with that model."""
    index_meta = load_index(index_dir).meta  # a broken index fails here, naming its file
    embedding = embedding_parts(weights_file)
    model_dim = embedding.metadata["dmltrain_embedding_dim"]
    if int(index_meta["dim"]) != model_dim:
        raise ValueError(
            f"{index_dir} holds {index_meta['dim']}-d embeddings but the model {weights_file} makes "
            f"{model_dim}-d ones: give the model the index was built with"
        )
    return dataclasses.replace(
        embedding,
        code_file=_SEARCH_CODE,
        artifacts={**embedding.artifacts, INDEX_ARTIFACT: str(index_dir)},
        signature=search_signature(embedding.signature),
        requirements=[*embedding.requirements, _faiss_requirement()],
        metadata={
            **embedding.metadata,
            "dmltrain_index": {
                key: index_meta.get(key)
                for key in ("dataset", "split", "ntotal", "description", "model", "created")
            },
        },
    )
