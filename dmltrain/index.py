"""faiss indexes over L2-normalised embeddings: build one sized to the gallery, search it, store it.

Similarity is the inner product (= cosine for unit vectors) everywhere. The kind is chosen by gallery size:

- ``flat``: exact search (``IndexFlatIP``), for galleries up to ``EXACT_LIMIT`` rows, where a brute-force
  scan is fast enough and nothing is lost;
- ``ivfpq``: an inverted file over ``nlist ~ sqrt(n)`` k-means cells with product-quantised codes, ``nprobe``
  cells scanned per query, then the best ``refine x k`` candidates re-ranked exactly against the stored
  vectors (``IndexRefineFlat``) — the default for large galleries. On CPU the codes are 4-bit fast-scan
  (``PQ{m}x4fs``: SIMD lookups, and training 16 centroids per sub-space instead of 256, which costs minutes
  at 8 bits on a small machine); with a GPU they are 8-bit (``PQ{m}x8``), the form faiss-gpu builds;
- ``hnsw``: a graph index (``IndexHNSWFlat``, ``M`` links per node, ``efConstruction``/``efSearch``), high
  recall without training, CPU only in faiss.

A GPU is used where faiss sees one (faiss-gpu installed): flat search runs there, and IVF-PQ is trained and
filled there; what is stored is always the CPU form, so an index built on a GPU loads anywhere. One GPU per
process: torch's current device where torch has set one up (a Ray Train worker sees its node's other GPUs
too, which belong to other ranks), else the first. The id map
(row -> shard, key, class) travels beside the index; nothing here imports torch, Ray or MLflow.

A stored index is memory-mapped where the faiss build can (``IO_FLAG_MMAP_IFC``, in faiss 1.15): its
vectors and codes stay in the page cache, shared by every process that serves it, instead of one private
copy per server worker; `save_index` therefore replaces files by renaming, never rewriting one a server maps.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sys
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

log = logging.getLogger("dmltrain.index")

__all__ = [
    "EXACT_LIMIT",
    "EmbeddingIndex",
    "IdMap",
    "IndexSpec",
    "StoredIndex",
    "approximate_retrieval_metrics",
    "build_index",
    "choose_spec",
    "exact_knn",
    "load_index",
    "neighbour_recall",
    "save_index",
]

IndexKind = Literal["auto", "flat", "ivfpq", "hnsw"]

# Up to this many gallery rows an exact scan is cheap (1M x 128 floats = 512 MB; a query costs n x d flops).
EXACT_LIMIT = 250_000
INDEX_FILE = "index.faiss"
IDS_FILE = "ids.npz"
META_FILE = "index.json"
INDEX_FILES = (INDEX_FILE, IDS_FILE, META_FILE)  # an index directory's own files
FORMAT_VERSION = 1
# faiss-gpu answers at most this many neighbours per query (GPU_MAX_SELECTION_K); more are found on the CPU
GPU_MAX_K = 2048
# Bytes per 8-bit PQ code that faiss-gpu's IVF-PQ kernels support (GpuIndexIVFPQ)
_GPU_PQ_BYTES = (1, 2, 3, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 96)


def _faiss() -> Any:
    import faiss

    return faiss


def gpu_count() -> int:
    """GPUs faiss can use (0 with faiss-cpu)."""
    faiss = _faiss()
    return int(faiss.get_num_gpus()) if hasattr(faiss, "get_num_gpus") else 0


# ------------------------------------------------------------------------------------------------- spec
@dataclass(frozen=True)
class IndexSpec:
    """What to build, with every parameter stated (stored in index.json and printed by the CLI)."""

    kind: Literal["flat", "ivfpq", "hnsw"]
    nlist: int = 0  # ivfpq: k-means cells
    m: int = 0  # ivfpq: PQ sub-quantisers
    nbits: int = 4  # ivfpq: bits per sub-quantiser code (4 = fast-scan on CPU, 8 on GPU)
    nprobe: int = 0  # ivfpq: cells scanned per query
    refine: int = 0  # ivfpq: re-rank refine x k candidates exactly (0 = no re-ranking)
    train_size: int = 0  # ivfpq: vectors k-means and PQ are trained on
    hnsw_m: int = 0  # hnsw: links per node
    ef_construction: int = 0  # hnsw
    ef_search: int = 0  # hnsw: candidate list length per query

    def describe(self) -> str:
        if self.kind == "flat":
            return "flat (exact inner product)"
        if self.kind == "ivfpq":
            refine = f", exact re-rank of {self.refine}k candidates" if self.refine else ""
            return f"{self.factory()} (nprobe {self.nprobe}, trained on {self.train_size} vectors{refine})"
        return f"HNSW{self.hnsw_m} (efConstruction {self.ef_construction}, efSearch {self.ef_search})"

    def factory(self) -> str:
        """faiss index_factory string of the IVF-PQ base (``np``: no polysemous training, slow and unused)."""
        codes = f"PQ{self.m}x4fs" if self.nbits == 4 else f"PQ{self.m}x{self.nbits}np"
        return f"IVF{self.nlist},{codes}"


def _pq_subquantizers(dim: int, nbits: int) -> int:
    """Largest divisor of ``dim`` up to 64 with 2 dimensions per 4-bit code or 4 per 8-bit code: even for
    fast-scan; for 8-bit codes (the GPU's form) one of the code sizes faiss-gpu's IVF-PQ supports, whose
    lookup tables it keeps in float16 (`_to_gpu`: float32 tables of 56 or 64 sub-quantizers would not fit
    a GPU block's shared memory)."""
    per_code = 2 if nbits == 4 else 4
    limit = max(1, min(64, dim // per_code))
    fits = [
        m
        for m in range(1, limit + 1)
        if dim % m == 0 and (m % 2 == 0 if nbits == 4 else nbits != 8 or m in _GPU_PQ_BYTES)
    ]
    if not fits:
        raise ValueError(f"no product quantiser fits dimension {dim} with {nbits}-bit codes")
    return max(fits)


def choose_spec(
    n: int, dim: int, kind: IndexKind = "auto", *, exact_limit: int = EXACT_LIMIT, **overrides: int
) -> IndexSpec:
    """The index for ``n`` vectors of ``dim``: exact up to ``exact_limit`` rows, else IVF-PQ (``auto``).

    Parameters: ``nlist`` the power of two nearest sqrt(n) with at least 39 training vectors per cell
    (faiss's rule; more cells make k-means the cost of a build on CPU), ``nprobe = nlist / 8`` (at least
    16), re-ranking 4k candidates; HNSW32 with efConstruction 80 and efSearch 128. ``overrides`` replace any
    field (e.g. ``nprobe=64``). The measured speed and recall are in bench/index.py's table (README).
    """
    if n < 1 or dim < 1:
        raise ValueError(f"cannot index {n} vectors of dimension {dim}")
    if kind == "auto":
        kind = "flat" if n <= exact_limit else "ivfpq"
    if kind == "flat":
        spec = IndexSpec("flat")
    elif kind == "ivfpq":
        nlist = 2 ** round(math.log2(max(1.0, math.sqrt(n))))
        nlist = int(max(1, min(nlist, n // 39, 65536)))
        nbits = overrides.get("nbits", 8 if gpu_count() > 0 else 4)
        spec = IndexSpec(
            "ivfpq",
            nlist=nlist,
            m=_pq_subquantizers(dim, nbits),
            nbits=nbits,
            nprobe=min(nlist, max(16, nlist // 8)),
            refine=4,
            train_size=int(min(n, max(39 * nlist, 2**16))),
        )
    elif kind == "hnsw":
        spec = IndexSpec("hnsw", hnsw_m=32, ef_construction=80, ef_search=128)
    else:
        raise ValueError(f"unknown index kind {kind!r}; expected auto, flat, ivfpq or hnsw")
    if overrides:
        unknown = set(overrides) - set(IndexSpec.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown index parameter(s) {sorted(unknown)}")
        spec = replace(spec, **overrides)
    if spec.kind == "ivfpq" and (dim % spec.m or spec.nlist < 1 or spec.nprobe < 1):
        raise ValueError(f"invalid IVF-PQ parameters for dimension {dim}: {spec}")
    return spec


# ------------------------------------------------------------------------------------------------ build
def _as_float32(x: Any, name: str) -> np.ndarray:
    a = x.detach().float().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)  # bf16 has no numpy
    if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D array (n, dim), got shape {a.shape}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise ValueError(f"{name} contains NaN or inf")
    return a


def _unit_rows(a: np.ndarray, name: str) -> np.ndarray:
    """Rows scaled to unit length, as the exact metrics rank them (cosine): an inner-product index over raw
    rows ranked by length too. Scaled by their largest entry first, so that no norm overflows."""
    scale = np.abs(a).max(axis=1, keepdims=True)
    if not (scale > 0).all():
        raise ValueError(
            f"{name} row {int(np.argmin(scale[:, 0]))} is all zeros: cosine similarity is undefined"
        )
    a = a / scale
    return np.ascontiguousarray(a / np.linalg.norm(a, axis=1, keepdims=True), dtype=np.float32)


@dataclass
class EmbeddingIndex:
    """A built faiss index (CPU form, plus a GPU copy where one is used) and what it was built as."""

    index: Any
    spec: IndexSpec
    dim: int
    build_seconds: float = 0.0
    _device_index: Any = field(default=None, repr=False, compare=False)
    # A GPU index is not safe to search from two threads at once (a scoring server's request threads do)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def _searcher(self, k: int) -> Any:
        with self._lock:
            if self._device_index is None:
                self._device_index = _maybe_to_gpu(self.index, self.spec)
        return self.index if k > GPU_MAX_K else self._device_index

    def search(self, queries: Any, k: int, *, chunk_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """``(similarities, ids)``, each (num_queries, k), best first; id -1 where fewer than k exist."""
        q = _as_float32(queries, "queries")
        if q.shape[1] != self.dim:
            raise ValueError(f"queries have dimension {q.shape[1]} but the index holds {self.dim}")
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        searcher = self._searcher(k)
        on_gpu = searcher is not self.index
        sims = np.empty((len(q), k), dtype=np.float32)
        ids = np.empty((len(q), k), dtype=np.int64)
        for lo in range(0, len(q), chunk_size):
            with self._lock if on_gpu else contextlib.nullcontext():
                s, i = searcher.search(q[lo : lo + chunk_size], k)
            sims[lo : lo + chunk_size], ids[lo : lo + chunk_size] = s, i
        return sims, ids


def _maybe_to_gpu(index: Any, spec: IndexSpec) -> Any:
    """Flat and un-refined 8-bit IVF-PQ indexes search on this process's GPU; others stay on the CPU."""
    if gpu_count() == 0 or spec.kind == "hnsw" or (spec.kind == "ivfpq" and (spec.refine or spec.nbits != 8)):
        return index
    return _to_gpu(index, ivfpq=spec.kind == "ivfpq")


def _gpu_device() -> int:
    """This process's GPU: torch's current device where torch has CUDA set up (without importing torch:
    this module stays torch-free), else 0. faiss and torch number the visible devices alike."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.current_device())
    return 0


@functools.cache
def _gpu_resources(device: int) -> Any:
    """One set of faiss GPU resources (streams, scratch memory) per device and process, made once."""
    return _faiss().StandardGpuResources()


def _to_gpu(index: Any, *, ivfpq: bool) -> Any:
    """A copy of a CPU ``index`` on this process's GPU (`_gpu_device`). IVF-PQ gets float16 lookup tables,
    which its 56- and 64-byte codes need; a flat index keeps float32 vectors (exact search)."""
    faiss = _faiss()
    options = faiss.GpuClonerOptions()
    options.useFloat16 = ivfpq
    device = _gpu_device()
    return faiss.index_cpu_to_gpu(_gpu_resources(device), device, index, options)


def build_index(
    embeddings: Any,
    spec: IndexSpec | IndexKind = "auto",
    *,
    seed: int = 0,
    add_chunk: int = 1 << 16,
) -> EmbeddingIndex:
    """Build the index ``spec`` describes (or choose one with :func:`choose_spec`) over ``embeddings``.

    Rows are added in order, so the index id of a row is its position in ``embeddings``. IVF-PQ trains on a
    seeded random sample of ``spec.train_size`` rows.
    """
    faiss = _faiss()
    x = _as_float32(embeddings, "embeddings")
    n, dim = x.shape
    if not isinstance(spec, IndexSpec):
        spec = choose_spec(n, dim, spec)
    started = time.perf_counter()
    ip = faiss.METRIC_INNER_PRODUCT
    if spec.kind == "flat":
        index = faiss.IndexFlatIP(dim)
        index.add(x)
    elif spec.kind == "hnsw":
        index = faiss.IndexHNSWFlat(dim, spec.hnsw_m, ip)
        index.hnsw.efConstruction = spec.ef_construction
        index.hnsw.efSearch = spec.ef_search
        for lo in range(0, n, add_chunk):
            index.add(x[lo : lo + add_chunk])
    else:
        base = faiss.index_factory(dim, spec.factory(), ip)
        sample = x
        if spec.train_size < n:
            rows = np.sort(np.random.default_rng(seed).choice(n, spec.train_size, replace=False))
            sample = x[rows]
        trained = base
        if (
            gpu_count() > 0 and spec.nbits == 8
        ):  # k-means and encoding are the costly part: do them on the GPU when possible
            trained = _to_gpu(base, ivfpq=True)
        trained.train(sample)
        for lo in range(0, n, add_chunk):
            trained.add(x[lo : lo + add_chunk])
        base = faiss.index_gpu_to_cpu(trained) if trained is not base else base
        faiss.extract_index_ivf(base).nprobe = spec.nprobe
        index = base
        if spec.refine:  # the exact copies the re-ranking reads; the base index is already filled
            index = faiss.IndexRefineFlat(base, faiss.swig_ptr(x))
            index.k_factor = float(spec.refine)
    return EmbeddingIndex(index, spec, dim, build_seconds=time.perf_counter() - started)


def _reapply_search_params(index: Any, spec: IndexSpec) -> None:
    """faiss stores nprobe/efSearch with the index; make a loaded index follow the stated spec."""
    faiss = _faiss()
    if spec.kind == "hnsw":
        faiss.downcast_index(index).hnsw.efSearch = spec.ef_search
    elif spec.kind == "ivfpq":
        faiss.extract_index_ivf(index).nprobe = spec.nprobe
        if spec.refine:
            faiss.downcast_index(index).k_factor = float(spec.refine)


# -------------------------------------------------------------------------------------- exact reference
def exact_knn(queries: Any, gallery: Any, k: int, *, chunk_size: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Exact top-k by inner product (faiss brute force, a GPU when faiss sees one): the reference that
    approximate indexes are measured against."""
    g = _as_float32(gallery, "gallery")
    return build_index(g, IndexSpec("flat")).search(queries, min(k, len(g)), chunk_size=chunk_size)


def neighbour_recall(approx_ids: np.ndarray, exact_ids: np.ndarray) -> float:
    """Mean share of each query's exact top-k found among its approximate top-k (faiss's k-recall@k)."""
    a, e = np.asarray(approx_ids), np.asarray(exact_ids)
    if a.shape != e.shape or a.ndim != 2 or a.size == 0:
        raise ValueError(f"id arrays must have one equal 2-D shape, got {a.shape} and {e.shape}")
    hits = sum(len(np.intersect1d(a[i][a[i] >= 0], e[i][e[i] >= 0])) for i in range(len(a)))
    return float(hits / max(1, int((e >= 0).sum())))


# ----------------------------------------------------------------------------------------------- id map
@dataclass
class IdMap:
    """Where each indexed row came from: shard index in its split, sample key, class id."""

    shard: np.ndarray  # int32 (n,)
    key: np.ndarray  # str (n,)
    label: np.ndarray  # int64 (n,)

    def __post_init__(self) -> None:
        self.shard = np.asarray(self.shard, dtype=np.int32)
        self.key = np.asarray(self.key, dtype=str)
        self.label = np.asarray(self.label, dtype=np.int64)
        if not len(self.shard) == len(self.key) == len(self.label):
            raise ValueError("id map columns differ in length")

    def __len__(self) -> int:
        return len(self.key)

    def row(self, i: int) -> dict[str, Any]:
        return {
            "id": int(i),
            "shard": int(self.shard[i]),
            "key": str(self.key[i]),
            "class": int(self.label[i]),
        }


@dataclass
class StoredIndex:
    """An index directory read back: the index, its id map and its metadata (``index.json``)."""

    index: EmbeddingIndex
    ids: IdMap
    meta: dict[str, Any]

    def search(self, queries: Any, k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.index.search(queries, k)

    def neighbours(self, queries: Any, k: int) -> list[list[dict[str, Any]]]:
        """Each query's ``k`` nearest rows, best first, as the id map names them: id, shard, key, class,
        score, class_name (from ``meta``, None when unknown). Fewer when the index holds fewer."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        # faiss pads past the index's size with -1, after allocating for all k: ask for what exists
        scores, ids = self.search(queries, max(1, min(k, self.index.ntotal)))
        names = self.meta.get("class_names", {})
        found = []
        for row_scores, row_ids in zip(scores, ids, strict=True):
            hits = []
            for score, i in zip(row_scores, row_ids, strict=True):
                if i < 0:  # faiss pads a short list with -1
                    continue
                hit = self.ids.row(int(i))
                hits.append({**hit, "score": float(score), "class_name": names.get(str(hit["class"]))})
            found.append(hits)
        return found


def save_index(
    directory: str | os.PathLike[str], index: EmbeddingIndex, ids: IdMap, meta: Mapping[str, Any]
) -> Path:
    """Write ``index.faiss`` (CPU form), ``ids.npz`` and ``index.json`` (spec, sizes, ``meta``).

    Each file is renamed into place on its own: ``ids.npz``, then ``index.faiss``, then ``index.json``,
    which records a build id (stored in ``ids.npz`` too) and the size of ``index.faiss``. `load_index`
    reads them in the opposite order (json, faiss, ids), so a reader that ran beside a rebuild and took
    ``index.faiss`` from the new build takes ``ids.npz`` from it too, and a json of the old build names
    the other build id: files of two builds are refused, not answered with another build's ids."""
    faiss = _faiss()
    if len(ids) != index.ntotal:
        raise ValueError(f"the id map has {len(ids)} rows but the index holds {index.ntotal}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    build = uuid.uuid4().hex

    def write_ids(path: str) -> None:
        with open(path, "wb") as handle:  # a handle: given a name, np.savez would append ".npz"
            np.savez(handle, shard=ids.shard, key=ids.key, label=ids.label, build=np.array(build))

    _replace_file(out / IDS_FILE, write_ids)  # this order: see the docstring
    _replace_file(out / INDEX_FILE, lambda path: faiss.write_index(index.index, path))
    record = {
        "format_version": FORMAT_VERSION,
        "build": build,
        "index_bytes": (out / INDEX_FILE).stat().st_size,
        "spec": asdict(index.spec),
        "description": index.spec.describe(),
        "ntotal": index.ntotal,
        "dim": index.dim,
        "build_seconds": round(index.build_seconds, 3),
        "faiss_version": getattr(faiss, "__version__", "unknown"),
        **dict(meta),
    }
    _replace_file(
        out / META_FILE, lambda path: Path(path).write_text(json.dumps(record, indent=2, sort_keys=True))
    )
    return out


def _replace_file(path: Path, write: Callable[[str], None]) -> None:
    """Write beside ``path``, then rename over it. Rewriting a file in place would crash (SIGBUS) a process
    that maps it (`load_index`, e.g. a running search service) once the file is shorter; after a rename it
    keeps the old file, and a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write(str(partial))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _read_flags(faiss: Any) -> int:
    """Map the stored vectors and codes rather than copy them; 0 (read into memory) where faiss cannot."""
    return int(getattr(faiss, "IO_FLAG_MMAP_IFC", 0))


def load_index(directory: str | os.PathLike[str]) -> StoredIndex:
    """Read an index directory written by :func:`save_index`; errors name the missing or mismatched file.

    The vectors and codes are mapped from ``index.faiss`` where faiss can (module docstring): N server
    processes then hold one copy, in the page cache. Replace the directory's files by renaming (as
    `save_index` does), not by rewriting them, while something has it loaded."""
    faiss = _faiss()
    root = Path(directory)
    for name in INDEX_FILES:
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root} is not a dmltrain index: {name} is missing")
    try:
        meta = json.loads((root / META_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{root / META_FILE}: not valid JSON ({exc})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        found = meta.get("format_version") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{root / META_FILE}: format_version {found} != {FORMAT_VERSION}")
    missing = [key for key in ("spec", "dim") if key not in meta]
    if missing:
        raise ValueError(f"{root / META_FILE}: no {', '.join(missing)} (written by `dmltrain index`?)")
    try:
        spec = IndexSpec(**meta["spec"])
    except TypeError as exc:
        raise ValueError(f"{root / META_FILE}: its spec is not one this version reads ({exc})") from None
    try:
        raw = faiss.read_index(str(root / INDEX_FILE), _read_flags(faiss))
    except RuntimeError as exc:  # faiss's message is a multi-line C++ trace; its last line says what failed
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise ValueError(
            f"{root / INDEX_FILE}: faiss cannot read it ({lines[-1] if lines else exc})"
        ) from None
    if raw.d != int(meta["dim"]):  # files of two builds: every search would fail inside faiss
        raise ValueError(
            f"{root}: {INDEX_FILE} holds {raw.d}-d vectors but {META_FILE} says dim {meta['dim']} (files of "
            "two different builds?): rebuild the index with `dmltrain index`"
        )
    _reapply_search_params(raw, spec)
    ids, build = _load_ids(root / IDS_FILE)
    if len(ids) != raw.ntotal:
        raise ValueError(f"{root}: {IDS_FILE} has {len(ids)} rows but {INDEX_FILE} holds {raw.ntotal}")
    _check_one_build(root, meta, build)
    return StoredIndex(EmbeddingIndex(raw, spec, int(meta["dim"])), ids, meta)


def _check_one_build(root: Path, meta: Mapping[str, Any], ids_build: str | None) -> None:
    """Files of two builds pass every shape check when the rebuild kept the images (a rerun, a new model
    of the same size), and would answer with one build's vectors and another's ids or model digest.
    Indexes written before builds were recorded have neither mark and are taken as they are."""
    again = "files of two builds (an index rebuilt while it was read?): load it again, or rebuild it"
    if "build" in meta and ids_build != meta["build"]:
        raise ValueError(f"{root}: {IDS_FILE} and {META_FILE} are {again}")
    size = meta.get("index_bytes")
    if size is not None and (root / INDEX_FILE).stat().st_size != size:
        raise ValueError(f"{root}: {INDEX_FILE} and {META_FILE} are {again}")


def _load_ids(path: Path) -> tuple[IdMap, str | None]:
    """The id map, its columns memory-mapped from ``ids.npz`` like the index itself: server processes then
    share one copy (the keys alone are 64 MB per million rows as numpy strings). np.savez stores members
    uncompressed, so each ``.npy`` member lies whole in the archive; anything else is read normally.
    Also the build id `save_index` stored beside the columns (None in an older map)."""
    columns = {}
    with open(path, "rb") as handle:
        if handle.read(4) != b"PK\x03\x04":  # numpy would call anything else "pickled data"
            raise ValueError(f"{path}: not a readable id map (not an .npz archive)")
    try:
        data = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{path}: not a readable id map ({type(exc).__name__}: {exc})") from None
    with data:
        for name in ("shard", "key", "label"):
            if name not in data.files:
                raise ValueError(f"{path}: no '{name}' column (a dmltrain id map holds shard, key and label)")
        try:
            columns = {name: _mapped_member(path, f"{name}.npy") for name in ("shard", "key", "label")}
        except (ValueError, OSError, KeyError, zipfile.BadZipFile):  # KeyError: members named otherwise
            try:
                columns = {name: data[name] for name in ("shard", "key", "label")}
            except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:  # a damaged member
                raise ValueError(f"{path}: not a readable id map ({type(exc).__name__}: {exc})") from None
        try:
            build = str(data["build"]) if "build" in data.files else None
        except (ValueError, OSError, zipfile.BadZipFile, EOFError):
            build = "unreadable"  # differs from any recorded build: named as files of two builds
    return IdMap(columns["shard"], columns["key"], columns["label"]), build


def _mapped_member(path: Path, member: str) -> np.ndarray:
    """A stored (uncompressed) ``.npy`` member of a zip archive, mapped read-only; ValueError if it is not
    one that can be mapped (compressed, Fortran order, an object array)."""
    with zipfile.ZipFile(path) as archive:
        info = archive.getinfo(member)
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{member} is compressed")
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        local = handle.read(30)  # the local file header; its name and extra field lengths vary
        if local[:4] != b"PK\x03\x04":
            raise ValueError(f"{member}: no local file header")
        name_length, extra_length = (
            int.from_bytes(local[26:28], "little"),
            int.from_bytes(local[28:30], "little"),
        )
        start = info.header_offset + 30 + name_length + extra_length
        handle.seek(start)
        version = np.lib.format.read_magic(handle)
        readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        if version not in readers:
            raise ValueError(f"{member}: .npy format {version}")
        shape, fortran, dtype = readers[version](handle)
        offset = handle.tell()
    if fortran or dtype.hasobject:
        raise ValueError(f"{member} cannot be mapped")
    if math.prod(shape) == 0:
        return np.empty(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


# ------------------------------------------------------------------------------- approximate evaluation
def _label_array(y: Any, n: int, name: str) -> np.ndarray:
    a = y.detach().cpu().numpy() if hasattr(y, "detach") else np.asarray(y)
    if a.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {a.shape}")
    return a


def approximate_retrieval_metrics(
    query_embeddings: Any,
    query_labels: Any,
    gallery_embeddings: Any | None = None,
    gallery_labels: Any | None = None,
    ks: tuple[int, ...] = (1, 2, 4, 8),
    *,
    kind: IndexKind = "ivfpq",
    recall_queries: int = 1000,
    recall_k: int = 10,
    max_k: int = 1024,
    seed: int = 0,
    chunk_size: int = 4096,
) -> dict[str, float]:
    """Recall@K, MAP@R and R-precision from a faiss index's top-k lists, for galleries too large to rank
    exactly; plus ``index_recall@{recall_k}``: how much of the exact top ``recall_k`` the index returns, on
    ``recall_queries`` queries sampled with ``seed`` (exact search on that sample only).

    Without a gallery the queries search each other, each skipping itself. Full-ranking mAP needs every
    positive's rank and is not reported; MAP@R and R-precision look at the top R (capped at ``max_k``, so
    a class larger than that is scored on its first ``max_k`` ranks: a lower bound, counted in
    ``num_queries_deeper_than_search`` beside ``search_depth``, and logged). Ties keep faiss's order (the
    exact path, `dmltrain.evaluation.retrieval_metrics`, ranks ties pessimistically). Rows are ranked by
    cosine similarity, as on the exact path."""
    q = _unit_rows(_as_float32(query_embeddings, "query_embeddings"), "query_embeddings")
    q_lab = _label_array(query_labels, len(q), "query_labels")
    leave_one_out = gallery_embeddings is None
    g = (
        q
        if leave_one_out
        else _unit_rows(_as_float32(gallery_embeddings, "gallery_embeddings"), "gallery_embeddings")
    )
    g_lab = q_lab if leave_one_out else _label_array(gallery_labels, len(g), "gallery_labels")
    if g.shape[1] != q.shape[1]:
        raise ValueError(f"gallery dimension {g.shape[1]} != query dimension {q.shape[1]}")
    ks = tuple(sorted({int(k) for k in ks}))
    classes, counts = np.unique(g_lab, return_counts=True)
    where = np.searchsorted(classes, q_lab)
    found = (where < len(classes)) & (classes[np.minimum(where, len(classes) - 1)] == q_lab)
    r = np.where(found, counts[np.minimum(where, len(classes) - 1)], 0) - (1 if leave_one_out else 0)
    k = int(min(max(max(ks), int(r.max(initial=0)), recall_k), max_k, len(g) - (1 if leave_one_out else 0)))
    built = build_index(g, kind, seed=seed)
    extra = 1 if leave_one_out else 0
    first = np.zeros(len(q), dtype=np.int64)  # rank of the first positive, 0 = none in the top k
    map_r = np.zeros(len(q))
    r_prec = np.zeros(len(q))
    rows = np.arange(len(q))
    for lo in range(0, len(q), chunk_size):
        _, ids = built.search(q[lo : lo + chunk_size], k + extra)
        if leave_one_out:
            ids = _drop_self(ids, rows[lo : lo + chunk_size], k)
        rel = (ids >= 0) & (g_lab[np.maximum(ids, 0)] == q_lab[lo : lo + chunk_size, None])
        rr = np.minimum(r[lo : lo + chunk_size], k)
        within = np.arange(k)[None, :] < rr[:, None]
        hits = np.cumsum(rel, axis=1)
        precision = np.where(rel & within, hits / np.arange(1, k + 1)[None, :], 0.0)
        denom = np.maximum(r[lo : lo + chunk_size], 1)
        map_r[lo : lo + chunk_size] = precision.sum(axis=1) / denom
        r_prec[lo : lo + chunk_size] = (rel & within).sum(axis=1) / denom
        first[lo : lo + chunk_size] = np.where(rel.any(axis=1), rel.argmax(axis=1) + 1, 0)
    valid = r > 0
    if not valid.any():
        raise ValueError(
            "none of the queries has a relevant item in the gallery: retrieval metrics are undefined"
        )
    out = {f"recall@{kk}": float(np.mean((first[valid] > 0) & (first[valid] <= kk))) for kk in ks}
    out["map@r"] = float(map_r[valid].mean())
    out["r_precision"] = float(r_prec[valid].mean())
    out["num_queries"] = int(valid.sum())
    out["num_queries_without_positive"] = int((~valid).sum())
    # MAP@R looks at R ranks; a class larger than the search depth is scored on the first k only, and so
    # is a Recall@K beyond it: both are then lower bounds, which the result and the log say.
    deeper = int((r[valid] > k).sum())
    out["search_depth"] = k
    out["num_queries_deeper_than_search"] = deeper
    beyond = max(ks) > k and k == max_k  # a K past a gallery smaller than it is exact, not a bound
    if deeper or beyond:
        log.warning(
            "faiss %s search depth %d: MAP@R and R-precision of %d of %d queries (classes of more than %d "
            "gallery items)%s are lower bounds; the exact ranking (eval.index=exact) has no depth",
            kind,
            k,
            deeper,
            int(valid.sum()),
            k,
            f" and recall@{max(ks)}" if beyond else "",
        )
    # How close the index is to exact search, on a sample of queries.
    rk = int(min(recall_k, len(g) - extra))
    sample = np.sort(np.random.default_rng(seed).choice(len(q), min(recall_queries, len(q)), replace=False))
    _, approx = built.search(q[sample], rk + extra)
    _, exact = exact_knn(q[sample], g, rk + extra)
    if leave_one_out:
        approx, exact = _drop_self(approx, sample, rk), _drop_self(exact, sample, rk)
    out[f"index_recall@{rk}"] = neighbour_recall(approx, exact)
    return out


def _drop_self(ids: np.ndarray, self_rows: np.ndarray, k: int) -> np.ndarray:
    """Each row's top k without the query itself (the last entry goes when the query was not returned)."""
    drop = ids == self_rows[:, None]
    drop[~drop.any(axis=1), -1] = True
    return ids[~drop].reshape(len(ids), -1)[:, :k]
