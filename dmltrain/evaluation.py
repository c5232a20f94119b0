"""Exact retrieval evaluation: Recall@K, mAP (full ranking), MAP@R and R-precision under cosine similarity.

Why not a k-NN search: full-ranking mAP needs the rank of *every* relevant item, which a top-k search cannot
give without a second pass over the gallery. Instead each block of queries is scored against the whole
gallery with one matrix product, and the rank of each positive is found by counting the gallery items that
score at least as high. All metrics then follow from those ranks, in a single pass, with memory bounded by
the block size. The nearest-neighbour lists for visualisation come from faiss (`nearest_neighbors`).

Tie rule (applies to every metric): items are ranked by decreasing similarity, and an item that ties with a
positive on similarity counts as ranked *before* it unless it is itself a positive (ties are resolved
pessimistically: negatives first). Tied positives are interchangeable, so their order does not matter.
A collapsed embedding (all vectors equal) therefore scores Recall@1 = 0 instead of a flattering value.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, Literal

import numpy as np
import torch

# IJB-C-style 1:1 template verification (face protocol, Smooth-AP Sec. 5.4) lives in its own module.
from dmltrain.verification import (
    VerificationProtocol,
    load_verification_protocol,
    tar_at_far,
    template_features,
    verification_metrics,
)

__all__ = [
    "PROTOCOL_DEFAULT_KS",
    "VerificationProtocol",
    "evaluate_protocol",
    "load_verification_protocol",
    "nearest_neighbors",
    "retrieval_metrics",
    "tar_at_far",
    "template_features",
    "vehicleid_gallery_split",
    "verification_metrics",
]

# A block of similarities holds at most this many float32 values (256 MiB); the query chunk is sized from it.
_BLOCK_ELEMENTS = 1 << 26
_BLOCK_ROWS = 16  # query rows of a block are a multiple of this (ties: see _iter_ranks)
# Counting by sorting the candidates costs about this many comparison passes per candidate (measured on CPU).
_SORT_PASSES = 16.0
# Comparison passes run over row slabs of about this many values (1 MiB of float32: stays in L2 cache).
_SLAB_ELEMENTS = 1 << 18
# Candidates kept for sorting are counted whenever this many have accumulated (bounds their memory).
_CANDIDATE_BUDGET = 1 << 22
# On the torch (GPU) path, above this many positives per query a row sort beats one pass per positive.
_TORCH_MAX_PASSES = 32

# Recall@K cut-offs each paper reports for a dataset (FastAP Tables 1-3, Smooth-AP Tables 2-3, RLL Tables).
PROTOCOL_DEFAULT_KS: dict[str, tuple[int, ...]] = {
    "sop": (1, 10, 100, 1000),
    "cub": (1, 2, 4, 8),
    "cars": (1, 2, 4, 8),
    "inaturalist": (1, 4, 16, 32),
    "inshop": (1, 10, 20, 30, 40, 50),
    "vehicleid": (1, 5),
    "leave_one_out": (1, 2, 4, 8),
    "query_gallery": (1, 2, 4, 8),
}
_PROTOCOL_OF = {
    "sop": "leave_one_out",
    "cub": "leave_one_out",
    "cars": "leave_one_out",
    "inaturalist": "leave_one_out",
    "leave_one_out": "leave_one_out",
    "inshop": "query_gallery",
    "query_gallery": "query_gallery",
    "vehicleid": "vehicleid",
}

ArrayLike = np.ndarray | torch.Tensor | Sequence[Any]


# ----------------------------------------------------------------------------------------------- inputs
def _embeddings(x: ArrayLike, name: str) -> torch.Tensor:
    """L2-normalised float32 tensor; refuses bad shapes, NaN/inf and zero rows, naming the argument."""
    t = x.detach() if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    if t.ndim != 2 or t.shape[0] == 0 or t.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D array (n, dim), got shape {tuple(t.shape)}")
    if not (t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64)):
        raise ValueError(f"{name} must hold real numbers, got dtype {t.dtype}")
    t = t.to(torch.float32)
    finite = torch.isfinite(t).all(dim=1)
    if not bool(finite.all()):
        row = int(torch.nonzero(~finite)[0, 0])
        raise ValueError(f"{name} row {row} contains NaN or inf")
    # Each row at unit scale first: a float32 norm overflows past |x| ~ 1.8e19 (the row became zeros and
    # tied with everything) and underflows to 0 below ~1e-23 (a row refused as all zeros).
    scale = t.abs().amax(dim=1, keepdim=True)
    if not bool((scale > 0).all()):
        row = int(torch.nonzero(scale[:, 0] <= 0)[0, 0])
        raise ValueError(f"{name} row {row} is all zeros: cosine similarity is undefined for it")
    t = t / scale
    return t / torch.linalg.vector_norm(t, dim=1, keepdim=True)


def _labels(y: ArrayLike, n: int, name: str) -> np.ndarray:
    """1-D label array of length n; integer or string values (floats would hide NaN and rounding bugs)."""
    a = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {a.shape}")
    if len(a) != n:
        raise ValueError(f"{name} has {len(a)} entries but its embeddings have {n} rows")
    if a.dtype.kind not in "iubUSO":
        raise ValueError(f"{name} must hold integer (or string) class ids, got dtype {a.dtype}")
    return a


def _ks(ks: Sequence[int]) -> tuple[int, ...]:
    out = tuple(sorted({int(k) for k in ks}))
    if not out or out[0] < 1 or any(int(k) != k for k in ks):
        raise ValueError(f"ks must be positive integers, got {ks!r}")
    return out


def _default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------------------------- counting
def _sortable_keys(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """uint64 keys ordered by (row, value) exactly: row in the high word, an order-preserving image of the
    float32 bits in the low word (so no rounding can merge or split ties)."""
    u = (values + np.float32(0.0)).astype(np.float32).view(np.uint32)  # +0.0 folds -0.0 into +0.0
    key = np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000))
    return (rows.astype(np.uint64) << np.uint64(32)) | key.astype(np.uint64)


def _count_rows(s: np.ndarray, thr: np.ndarray, r: np.ndarray) -> np.ndarray:
    """counts[i, j] = #{g : s[i, g] >= thr[i, j]} for j < r[i] (thr sorted decreasing, +inf beyond r[i]).

    Works over slabs of rows that fit in cache. One comparison against each row's lowest threshold (its
    worst positive) finds the candidates; then, per slab, either one more pass per threshold while the slab
    is still in cache (many candidates: untrained models), or the few candidates are kept and later sorted
    and binary-searched (trained models leave few items above their worst positive)."""
    b, n = s.shape
    w = thr.shape[1]
    p = int(r.max())
    out = np.zeros((b, w), dtype=np.int64)
    worst = thr[np.arange(b), r - 1][:, None]
    slab = max(1, _SLAB_ELEMENTS // n)
    mask = np.empty((min(slab, b), n), dtype=bool)
    light_vals: list[np.ndarray] = []
    light_rows: list[np.ndarray] = []

    def count_candidates() -> None:
        """Sort the kept candidates by (row, similarity) and binary-search every threshold of their rows."""
        rows = np.concatenate(light_rows)
        keys = _sortable_keys(np.concatenate(light_vals), rows)
        keys.sort()
        lr = np.unique(rows)  # every row of a light slab has its worst positive among the candidates
        tkeys = _sortable_keys(thr[lr, :p].ravel(), np.repeat(lr, p))
        ends = np.searchsorted(keys, (lr + 1).astype(np.uint64) << np.uint64(32), side="left")
        out[lr, :p] = ends[:, None] - np.searchsorted(keys, tkeys, side="left").reshape(len(lr), p)
        light_vals.clear()
        light_rows.clear()

    kept = 0
    for lo in range(0, b, slab):
        hi = min(lo + slab, b)
        blk = s[lo:hi]
        m = np.greater_equal(blk, worst[lo:hi], out=mask[: hi - lo])
        if p > 1 and p - 1 > 1 + _SORT_PASSES * np.count_nonzero(m) / m.size:
            idx = np.flatnonzero(m)
            light_vals.append(blk.ravel()[idx])
            light_rows.append(lo + idx // n)
            kept += len(idx)
            if kept >= _CANDIDATE_BUDGET:  # bounded memory even when nearly everything is a candidate
                count_candidates()
                kept = 0
            continue
        out[np.arange(lo, hi), r[lo:hi] - 1] = m.view(np.uint8).sum(axis=1, dtype=np.int64)
        for j in range(p - 1):
            np.greater_equal(blk, thr[lo:hi, j : j + 1], out=m)
            out[lo:hi, j] = m.view(np.uint8).sum(axis=1, dtype=np.int64)
    if light_vals:
        count_candidates()
    return out


def _count_at_least_numpy(
    s: np.ndarray, thr: np.ndarray, r: np.ndarray, pool: ThreadPoolExecutor | None
) -> np.ndarray:
    """`_count_rows` with the rows split over the pool's threads (numpy releases the GIL in these loops)."""
    parts = 1 if pool is None else min(pool._max_workers, len(s))
    if parts <= 1:
        return _count_rows(s, thr, r)
    cuts = np.linspace(0, len(s), parts + 1).astype(int)
    jobs = [pool.submit(_count_rows, s[a:z], thr[a:z], r[a:z]) for a, z in pairwise(cuts)]
    return np.concatenate([j.result() for j in jobs])


def _count_at_least_torch(s: torch.Tensor, thr: torch.Tensor, p: int) -> torch.Tensor:
    """Same counts as the numpy version with torch ops (the GPU path): one pass per threshold, or one row
    sort plus a batched binary search when there are many positives per query."""
    if p <= _TORCH_MAX_PASSES:
        return torch.stack([(s >= thr[:, j : j + 1]).sum(dim=1) for j in range(p)], dim=1)
    ordered = torch.sort(s, dim=1).values
    return s.shape[1] - torch.searchsorted(ordered, thr[:, :p].contiguous(), right=False)


def _positives_at_least(v: np.ndarray) -> np.ndarray:
    """m[i, j] = number of positives scoring >= v[i, j] (v sorted decreasing): the end of j's tie group."""
    b, w = v.shape
    end = np.ones((b, w), dtype=bool)
    end[:, :-1] = v[:, :-1] != v[:, 1:]
    mark = np.where(end, np.arange(w), w)
    return np.minimum.accumulate(mark[:, ::-1], axis=1)[:, ::-1] + 1


# ------------------------------------------------------------------------------------------------ ranks
@dataclass
class _Ranks:
    """1-based ranks of each query's positives in its full ranking (sorted; columns >= num_pos unused)."""

    query_index: np.ndarray  # (b,) row in the query set
    num_pos: np.ndarray  # (b,) R: relevant items in the gallery for that query
    ranks: np.ndarray  # (b, w) int64


def _iter_ranks(
    q: torch.Tensor,
    q_cls: np.ndarray,
    g: torch.Tensor,
    g_cls: np.ndarray,
    leave_one_out: bool,
    chunk_size: int | None,
    backend: Literal["numpy", "torch"],
    pool: ThreadPoolExecutor | None = None,
) -> Iterator[_Ranks]:
    """Yield the positives' ranks block by block; only queries with at least one positive are visited."""
    n_g = g.shape[0]
    order = np.argsort(g_cls, kind="stable")
    n_cls = int(max(q_cls.max(), g_cls.max())) + 1
    count = np.bincount(g_cls, minlength=n_cls)
    start = np.concatenate([[0], np.cumsum(count)[:-1]])
    num_pos = count[q_cls] - (1 if leave_one_out else 0)
    valid = np.flatnonzero(num_pos > 0)
    # Chunks of queries with similar R keep the per-chunk work (one pass per positive) even.
    valid = valid[np.argsort(num_pos[valid], kind="stable")]
    if chunk_size is None:
        chunk_size = max(1, min(4096, _BLOCK_ELEMENTS // n_g))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    gt = g.T.contiguous() if g.device.type != "cpu" else g.T
    # Every block is a product of a multiple of _BLOCK_ROWS query rows (padded with its last query) and at
    # least _BLOCK_ROWS gallery columns (a small gallery padded with zeros): on the CPU, products of fewer
    # than 12 rows or columns that are not a multiple of 4 take kernels that gave identical items
    # similarities one bit apart, so exact duplicates stopped tying and the tie rule failed for them (the
    # last block of 4097 queries, a small chunk_size, a gallery of 6 or 9 items).
    chunk_size = max(_BLOCK_ROWS, chunk_size // _BLOCK_ROWS * _BLOCK_ROWS)
    width = max(n_g, _BLOCK_ROWS)
    if width > n_g:
        gt = torch.cat([gt, gt.new_zeros(gt.shape[0], width - n_g)], dim=1)
    rows = -(-min(chunk_size, len(valid)) // _BLOCK_ROWS) * _BLOCK_ROWS
    block = torch.empty((rows, width), dtype=torch.float32, device=g.device)
    for lo in range(0, len(valid), chunk_size):
        qi = valid[lo : lo + chunk_size]
        b = len(qi)
        padded = np.pad(qi, (0, -(-b // _BLOCK_ROWS) * _BLOCK_ROWS - b), mode="edge")
        s_t = torch.mm(q[torch.as_tensor(padded, device=q.device)], gt, out=block[: len(padded)])[:b]
        if width > n_g:
            s_t = s_t[:, :n_g].contiguous()
        rp = num_pos[qi]
        w = int(count[q_cls[qi]].max())  # gathered width: the whole class (self included in leave-one-out)
        offs = np.arange(w)
        in_cls = offs[None, :] < count[q_cls[qi]][:, None]
        pos = order[np.where(in_cls, start[q_cls[qi]][:, None] + offs[None, :], 0)]
        if backend == "numpy":
            s = s_t.numpy()
            if leave_one_out:
                s[np.arange(b), qi] = -np.inf
            v = np.take_along_axis(s, pos, axis=1)
            v[~in_cls] = -np.inf
            v = -np.sort(-v, axis=1)
            thr = np.where(offs[None, :] < rp[:, None], v, np.inf).astype(np.float32)
            counts = _count_at_least_numpy(s, thr, rp, pool)
        else:
            if leave_one_out:
                s_t[torch.arange(b, device=s_t.device), torch.as_tensor(qi, device=s_t.device)] = -torch.inf
            v_t = s_t.gather(1, torch.as_tensor(pos, device=s_t.device))
            v_t[torch.as_tensor(~in_cls, device=s_t.device)] = -torch.inf
            v_t = torch.sort(v_t, dim=1, descending=True).values
            keep = torch.as_tensor(offs[None, :] < rp[:, None], device=s_t.device)
            thr_t = torch.where(keep, v_t, torch.full_like(v_t, torch.inf))
            p = int(rp.max())
            counts = np.zeros((b, w), dtype=np.int64)
            counts[:, :p] = _count_at_least_torch(s_t, thr_t, p).cpu().numpy()
            v = v_t.cpu().numpy()
        # counts include the positives tied with or above each one; the rest are negatives ranked before it
        negatives_before = counts - _positives_at_least(v)
        ranks = offs[None, :] + 1 + negatives_before
        yield _Ranks(query_index=qi, num_pos=rp, ranks=ranks)


def _class_ids(q_labels: np.ndarray, g_labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    _, inv = np.unique(np.concatenate([q_labels, g_labels]), return_inverse=True)
    inv = inv.astype(np.int64)
    return inv[: len(q_labels)], inv[len(q_labels) :]


def _retrieval_metrics(
    query_embeddings: ArrayLike,
    query_labels: ArrayLike,
    gallery_embeddings: ArrayLike | None,
    gallery_labels: ArrayLike | None,
    ks: Sequence[int],
    chunk_size: int | None,
    device: str | torch.device | None,
    backend: Literal["auto", "numpy", "torch"],
) -> dict[str, float]:
    ks_ = _ks(ks)
    q = _embeddings(query_embeddings, "query_embeddings")
    q_lab = _labels(query_labels, q.shape[0], "query_labels")
    leave_one_out = gallery_embeddings is None
    if leave_one_out:
        if gallery_labels is not None:
            raise ValueError("gallery_labels given without gallery_embeddings")
        g, g_lab = q, q_lab
    else:
        if gallery_labels is None:
            raise ValueError("gallery_embeddings given without gallery_labels")
        g = _embeddings(gallery_embeddings, "gallery_embeddings")
        g_lab = _labels(gallery_labels, g.shape[0], "gallery_labels")
        if g.shape[1] != q.shape[1]:
            raise ValueError(
                f"gallery_embeddings have dimension {g.shape[1]} but query_embeddings have {q.shape[1]}"
            )
    dev = torch.device(device) if device is not None else _default_device()
    if backend == "auto":
        backend = "numpy" if dev.type == "cpu" else "torch"
    q = q.to(dev)
    g = q if leave_one_out else g.to(dev)
    q_cls, g_cls = _class_ids(q_lab, g_lab)
    if leave_one_out:
        g_cls = q_cls

    # Per-query values, summed once in query order at the end: the result cannot depend on the chunking.
    n_q = q.shape[0]
    done = np.zeros(n_q, dtype=bool)
    first = np.zeros(n_q, dtype=np.int64)
    ap, map_r, r_prec = np.zeros(n_q), np.zeros(n_q), np.zeros(n_q)
    threads = max(1, torch.get_num_threads()) if backend == "numpy" else 1
    with torch.no_grad(), ThreadPoolExecutor(max_workers=threads) as pool:
        for blk in _iter_ranks(q, q_cls, g, g_cls, leave_one_out, chunk_size, backend, pool):
            r, qi = blk.num_pos, blk.query_index
            w = blk.ranks.shape[1]
            valid = np.arange(w)[None, :] < r[:, None]
            rank = np.where(valid, blk.ranks, np.iinfo(np.int64).max)
            precision = np.where(valid, np.arange(1, w + 1)[None, :] / rank, 0.0)
            within_r = valid & (rank <= r[:, None])
            last = (r - 1)[:, None]  # cumulative sums run left to right: same order whatever the width
            ap[qi] = np.take_along_axis(np.cumsum(precision, axis=1), last, 1)[:, 0] / r
            map_r[qi] = np.take_along_axis(np.cumsum(precision * within_r, axis=1), last, 1)[:, 0] / r
            r_prec[qi] = within_r.sum(axis=1) / r
            first[qi] = rank[:, 0]
            done[qi] = True
    n_eval = int(done.sum())
    n_without = q.shape[0] - n_eval
    if n_eval == 0:
        raise ValueError(
            f"none of the {q.shape[0]} queries has a relevant item in the gallery"
            + (" (every class has a single image)" if leave_one_out else "")
            + ": retrieval metrics are undefined"
        )
    out: dict[str, float] = {f"recall@{k}": float(np.mean(first[done] <= k)) for k in ks_}
    out["map"] = float(np.mean(ap[done]))
    out["map@r"] = float(np.mean(map_r[done]))
    out["r_precision"] = float(np.mean(r_prec[done]))
    out["num_queries"] = n_eval
    out["num_queries_without_positive"] = n_without
    return out


# ------------------------------------------------------------------------------------------- public API
def retrieval_metrics(
    query_embeddings: ArrayLike,
    query_labels: ArrayLike,
    gallery_embeddings: ArrayLike | None = None,
    gallery_labels: ArrayLike | None = None,
    ks: Sequence[int] = (1, 2, 4, 8),
    *,
    chunk_size: int | None = None,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Exact cosine-similarity retrieval metrics, averaged over the queries that have a relevant item.

    Without a gallery every row is a query against all *other* rows (leave-one-out). Returns
    ``recall@K`` for each K (a positive within the top K), ``map`` (average precision over the whole
    gallery ranking), ``map@r`` (MAP@R, Musgrave et al. 2020, R = number of relevant items),
    ``r_precision``, ``num_queries`` (queries averaged over) and ``num_queries_without_positive``
    (excluded from the means). Ties are ranked pessimistically (see the module docstring). Inputs are
    torch tensors or numpy arrays; computation is float32 on ``device`` (default: CUDA when available),
    ``chunk_size`` queries at a time (default: blocks of ~256 MiB; rounded down to a multiple of 16, at
    least 16), and the result does not depend on it beyond float rounding (a block's shape can change a
    similarity's last bit, and so whether two nearly equal items tie; exact duplicates tie, as measured on
    x86 CPUs).
    """
    return _retrieval_metrics(
        query_embeddings, query_labels, gallery_embeddings, gallery_labels, ks, chunk_size, device, "auto"
    )


def nearest_neighbors(
    query_embeddings: ArrayLike,
    gallery_embeddings: ArrayLike | None = None,
    k: int = 8,
    *,
    self_indices: ArrayLike | None = None,
    chunk_size: int = 4096,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k gallery rows by cosine similarity, exact, with a faiss flat index from `dmltrain.index` (on a
    GPU when faiss sees one).

    Returns ``(indices, similarities)``, both (num_queries, k'), k' = min(k, usable gallery size), best
    first. Without a gallery the queries search each other, skipping themselves; with a gallery,
    ``self_indices[i]`` names the gallery row that *is* query i, to be skipped (e.g. a few queries drawn
    from a leave-one-out set). Order among exactly tied similarities is faiss's and unspecified. Meant for
    inspection (retrieval grids); the metrics come from `retrieval_metrics`.
    """
    from dmltrain.index import IndexSpec, build_index

    q = _embeddings(query_embeddings, "query_embeddings").cpu().numpy()
    if gallery_embeddings is None:
        if self_indices is not None:
            raise ValueError("self_indices only applies with gallery_embeddings (leave-one-out skips self)")
        g = q
        skip: np.ndarray | None = np.arange(len(q))
    else:
        g = _embeddings(gallery_embeddings, "gallery_embeddings").cpu().numpy()
        if g.shape[1] != q.shape[1]:
            raise ValueError(
                f"gallery_embeddings have dimension {g.shape[1]} but query_embeddings have {q.shape[1]}"
            )
        skip = None
        if self_indices is not None:
            skip = np.asarray(self_indices, dtype=np.int64)
            if skip.shape != (len(q),) or (len(skip) and (skip.min() < 0 or skip.max() >= len(g))):
                raise ValueError("self_indices must hold one gallery row (0 <= i < len(gallery)) per query")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    usable = len(g) - (1 if skip is not None else 0)
    if usable < 1:
        raise ValueError("the gallery has no item left to retrieve")
    k_out = min(k, usable)
    k_search = min(k_out + (1 if skip is not None else 0), len(g))
    index = build_index(g, IndexSpec("flat"))  # the same index code as `dmltrain index` (GPU when seen)
    out_i = np.empty((len(q), k_out), dtype=np.int64)
    out_s = np.empty((len(q), k_out), dtype=np.float32)
    for lo in range(0, len(q), max(1, chunk_size)):
        sims, idx = index.search(np.ascontiguousarray(q[lo : lo + chunk_size]), k_search)
        if skip is not None:
            drop = idx == skip[lo : lo + chunk_size, None]
            drop[~drop.any(axis=1), -1] = True  # self not returned (ties): drop the last instead
            keep = ~drop
            sims = sims[keep].reshape(len(idx), -1)
            idx = idx[keep].reshape(len(idx), -1)
        out_i[lo : lo + chunk_size] = idx[:, :k_out]
        out_s[lo : lo + chunk_size] = sims[:, :k_out]
    return out_i, out_s


def vehicleid_gallery_split(
    labels: ArrayLike, seed: int | Sequence[int] = 0
) -> tuple[np.ndarray, np.ndarray]:
    """One random image per class to the gallery, the rest as queries (Liu et al. 2016's re-id protocol).

    Returns ``(query_indices, gallery_indices)`` into ``labels``, reproducible from ``seed``."""
    lab = _labels(labels, len(labels), "labels")
    _, cls = np.unique(lab, return_inverse=True)
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(cls)), cls))  # classes in order, members shuffled
    first = np.ones(len(order), dtype=bool)
    first[1:] = cls[order][1:] != cls[order][:-1]
    return np.sort(order[~first]), np.sort(order[first])


def _index_set(sel: ArrayLike, n: int, name: str) -> np.ndarray:
    """Boolean mask or index list -> sorted unique indices, checked against n."""
    a = sel.detach().cpu().numpy() if isinstance(sel, torch.Tensor) else np.asarray(sel)
    if a.dtype == bool:
        if a.shape != (n,):
            raise ValueError(f"{name} is a boolean mask of shape {a.shape}, expected ({n},)")
        return np.flatnonzero(a)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"{name} must be a boolean mask or a 1-D list of integer indices")
    a = a.astype(np.int64)
    if a.size and (a.min() < 0 or a.max() >= n):
        raise ValueError(f"{name} has an index outside [0, {n})")
    if len(np.unique(a)) != len(a):
        raise ValueError(f"{name} lists an index twice")
    return a


def evaluate_protocol(
    embeddings: ArrayLike,
    labels: ArrayLike,
    protocol: str,
    *,
    query_mask: ArrayLike | None = None,
    gallery_mask: ArrayLike | None = None,
    test_sets: Mapping[str, ArrayLike] | None = None,
    vehicleid_gallery: Literal["leave_one_out", "one_per_class"] = "leave_one_out",
    num_repeats: int = 10,
    seed: int = 0,
    ks: Sequence[int] | None = None,
    prefix: str = "",
    chunk_size: int | None = None,
    device: str | torch.device | None = None,
) -> dict[str, float]:
    """Metrics of one evaluation split under a dataset's standard protocol, keys prefixed for logging.

    ``protocol`` is a dataset name (``sop``, ``cub``, ``cars``, ``inaturalist``: leave-one-out; ``inshop``:
    query/gallery; ``vehicleid``) or ``leave_one_out`` / ``query_gallery``. ``ks`` defaults to the
    Recall@K cut-offs the papers report for that dataset (`PROTOCOL_DEFAULT_KS`).

    - query/gallery: ``query_mask`` and ``gallery_mask`` (boolean masks or index lists over the rows,
      disjoint) pick the two sets; keys are ``{prefix}recall@1`` etc.
    - vehicleid: ``test_sets`` maps a name (``small``, ``medium``, ``large``) to the rows of that test set;
      keys are ``{prefix}{name}/recall@1`` etc. By default each test set is evaluated leave-one-out, as the
      FastAP and Smooth-AP papers and code do (Smooth-AP Sec. 5.2); ``vehicleid_gallery="one_per_class"``
      instead draws one gallery image per class, the rest being queries, ``num_repeats`` times from
      ``seed``, and reports the mean over draws (the original re-identification protocol).
    """
    key = protocol.lower()
    if key not in _PROTOCOL_OF:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {sorted(_PROTOCOL_OF)}")
    kind = _PROTOCOL_OF[key]
    ks_ = _ks(ks if ks is not None else PROTOCOL_DEFAULT_KS[key])
    emb = embeddings.detach() if isinstance(embeddings, torch.Tensor) else np.asarray(embeddings)
    n = emb.shape[0]
    lab = _labels(labels, n, "labels")

    def rows_of(x: Any, rows: np.ndarray) -> Any:
        return x[torch.as_tensor(rows)] if isinstance(x, torch.Tensor) else x[rows]

    def metrics(rows_q: np.ndarray, rows_g: np.ndarray | None) -> dict[str, float]:
        q_emb, q_lab = rows_of(emb, rows_q), lab[rows_q]
        if rows_g is None:
            return retrieval_metrics(q_emb, q_lab, ks=ks_, chunk_size=chunk_size, device=device)
        g_emb, g_lab = rows_of(emb, rows_g), lab[rows_g]
        return retrieval_metrics(q_emb, q_lab, g_emb, g_lab, ks_, chunk_size=chunk_size, device=device)

    if kind == "leave_one_out":
        res = metrics(np.arange(n), None)
        return {f"{prefix}{k}": v for k, v in res.items()}
    if kind == "query_gallery":
        if query_mask is None or gallery_mask is None:
            raise ValueError(f"protocol {protocol!r} needs query_mask and gallery_mask")
        qi = _index_set(query_mask, n, "query_mask")
        gi = _index_set(gallery_mask, n, "gallery_mask")
        both = np.intersect1d(qi, gi)
        if len(both):
            raise ValueError(
                f"query_mask and gallery_mask share row {int(both[0])} ({len(both)} rows in all): a query "
                "would retrieve itself; use leave_one_out for a set searched against itself"
            )
        if len(qi) == 0 or len(gi) == 0:
            raise ValueError("query_mask and gallery_mask must each select at least one row")
        res = metrics(qi, gi)
        return {f"{prefix}{k}": v for k, v in res.items()}
    # vehicleid
    if not test_sets:
        raise ValueError(
            "protocol 'vehicleid' needs test_sets, e.g. {'small': rows, 'medium': ..., 'large': ...}"
        )
    if vehicleid_gallery not in ("leave_one_out", "one_per_class"):
        raise ValueError(
            f"vehicleid_gallery must be 'leave_one_out' or 'one_per_class', got {vehicleid_gallery!r}"
        )
    if num_repeats < 1:
        raise ValueError(f"num_repeats must be >= 1, got {num_repeats}")
    out: dict[str, float] = {}
    for name, sel in test_sets.items():
        rows = _index_set(sel, n, f"test_sets[{name!r}]")
        if vehicleid_gallery == "leave_one_out":
            res = metrics(rows, None)
        else:
            runs = []
            for rep in range(num_repeats):
                qs, gs = vehicleid_gallery_split(lab[rows], seed=(seed, rep))
                runs.append(metrics(rows[qs], rows[gs]))
            res = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
        out.update({f"{prefix}{name}/{k}": v for k, v in res.items()})
    return out
