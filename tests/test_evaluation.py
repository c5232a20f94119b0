"""Retrieval metrics against a brute-force ranking (ties, unequal classes, gallery or leave-one-out, every
counting strategy and chunk size), hand-worked cases, invariances, input errors, faiss neighbours, protocols.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import dmltrain.evaluation as ev
from dmltrain.evaluation import (
    PROTOCOL_DEFAULT_KS,
    evaluate_protocol,
    nearest_neighbors,
    retrieval_metrics,
    vehicleid_gallery_split,
)

KS = (1, 2, 4, 8)


# ------------------------------------------------------------------------------------------ reference
def brute_force(q, ql, g=None, gl=None, ks=KS):
    """Metrics from an explicit full ranking per query: similarity descending, negatives before positives
    on equal similarity; standard textbook definitions over the ranked relevance list."""
    q = np.asarray(q, dtype=np.float64)
    loo = g is None
    g, gl = (q, ql) if loo else (np.asarray(g, dtype=np.float64), gl)
    qn = q / np.linalg.norm(q, axis=1, keepdims=True)
    gn = g / np.linalg.norm(g, axis=1, keepdims=True)
    sims = qn @ gn.T
    acc = {f"recall@{k}": [] for k in ks} | {"map": [], "map@r": [], "r_precision": []}
    without = 0
    for i in range(len(q)):
        cols = np.arange(len(g))
        if loo:
            cols = cols[cols != i]
        rel = np.asarray(gl)[cols] == np.asarray(ql)[i]
        big_r = int(rel.sum())
        if big_r == 0:
            without += 1
            continue
        ranked = rel[np.lexsort((rel, -sims[i, cols]))]
        precision_at = np.cumsum(ranked) / np.arange(1, len(ranked) + 1)
        for k in ks:
            acc[f"recall@{k}"].append(bool(ranked[:k].any()))
        acc["map"].append(float((precision_at * ranked).sum() / big_r))
        acc["map@r"].append(float((precision_at[:big_r] * ranked[:big_r]).sum() / big_r))
        acc["r_precision"].append(float(ranked[:big_r].sum() / big_r))
    out = {key: float(np.mean(v)) for key, v in acc.items()}
    out["num_queries"] = len(q) - without
    out["num_queries_without_positive"] = without
    return out


def assert_same(got, want, tol=1e-12):
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], abs=tol), key


def tied_embeddings(rng, n, dim=16, nonzero=4):
    """Unit vectors with `nonzero` entries of +-1/sqrt(nonzero): every dot product is exact in float32,
    and there are only 2 * nonzero + 1 distinct similarities, so ties are everywhere."""
    x = np.zeros((n, dim), dtype=np.float32)
    for row in x:
        row[rng.choice(dim, nonzero, replace=False)] = rng.choice([-1.0, 1.0], nonzero) / np.sqrt(nonzero)
    return x


def skewed_labels(rng, n, num_classes):
    """Unequal classes, including some singletons (queries without a positive)."""
    weights = 1.0 / np.arange(1, num_classes + 1) ** 1.1
    return rng.choice(num_classes, size=n, p=weights / weights.sum())


def run(q, ql, g=None, gl=None, ks=KS, chunk_size=None, backend="numpy"):
    return ev._retrieval_metrics(q, ql, g, gl, ks, chunk_size, "cpu", backend)


# ------------------------------------------------------------------------------ against brute force
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("dim,nonzero", [(8, 4), (32, 16)])
def test_leave_one_out_matches_brute_force_with_ties(backend, dim, nonzero):
    rng = np.random.default_rng(dim)
    x = tied_embeddings(rng, 260, dim, nonzero)
    y = skewed_labels(rng, 260, 70)
    want = brute_force(x, y)
    assert want["num_queries_without_positive"] > 0  # the data exercises exclusion
    for chunk in (None, 5, 13):
        assert_same(run(x, y, chunk_size=chunk, backend=backend), want)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_query_gallery_matches_brute_force_with_ties(backend):
    rng = np.random.default_rng(7)
    q, g = tied_embeddings(rng, 150), tied_embeddings(rng, 230)
    ql, gl = rng.integers(0, 60, 150), skewed_labels(rng, 230, 50)
    want = brute_force(q, ql, g, gl, ks=(1, 3, 10, 100))
    assert want["num_queries_without_positive"] > 0
    for chunk in (None, 4):
        assert_same(run(q, ql, g, gl, ks=(1, 3, 10, 100), chunk_size=chunk, backend=backend), want)


@pytest.mark.parametrize(
    "sort_passes,torch_passes,slab",
    [(0.0, 0, 1 << 18), (1e9, 10_000, 1 << 18), (0.0, 0, 64), (1e9, 10_000, 64), (16.0, 32, 300)],
    ids=["sort-candidates", "one-pass-each", "sort-small-slabs", "passes-small-slabs", "default-small-slabs"],
)
def test_every_counting_strategy_matches_brute_force(monkeypatch, sort_passes, torch_passes, slab):
    """Force each way of counting (passes / candidate sort, big or tiny cache slabs) and compare."""
    monkeypatch.setattr(ev, "_SORT_PASSES", sort_passes)
    monkeypatch.setattr(ev, "_TORCH_MAX_PASSES", torch_passes)
    monkeypatch.setattr(ev, "_SLAB_ELEMENTS", slab)
    monkeypatch.setattr(ev, "_CANDIDATE_BUDGET", 500 if slab < 1000 else 1 << 22)
    rng = np.random.default_rng(3)
    # big classes (up to ~40 positives) and small ones, with and without structure
    for labels in (rng.integers(0, 6, 300), skewed_labels(rng, 300, 90)):
        x = tied_embeddings(rng, 300, 16, 4)
        centres = tied_embeddings(rng, int(labels.max()) + 1, 16, 4)
        structured = centres[labels] + 0.25 * x  # positives near the top: few candidates
        for emb in (x, structured):
            want = brute_force(emb, labels)
            for backend in ("numpy", "torch"):
                assert_same(run(emb, labels, chunk_size=37, backend=backend), want, tol=1e-9)


def test_continuous_embeddings_match_brute_force():
    rng = np.random.default_rng(18)
    x = rng.standard_normal((120, 24)).astype(np.float32)
    y = skewed_labels(rng, 120, 24)
    # precondition: no positive/negative pair within 10x float32 rounding, so float64 is a fair reference
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = xn.astype(np.float64) @ xn.T.astype(np.float64)
    for i in range(len(x)):
        pos = s[i, (y == y[i]) & (np.arange(len(x)) != i)]
        neg = s[i, y != y[i]]
        if len(pos):
            assert np.abs(pos[:, None] - neg[None, :]).min() > 1e-6
    want = brute_force(x, y)
    assert_same(retrieval_metrics(x, y), want, tol=1e-9)
    assert_same(retrieval_metrics(torch.from_numpy(x), torch.from_numpy(y), chunk_size=9), want, tol=1e-9)


# ------------------------------------------------------------------------------------- known cases
def test_hand_worked_example():
    # unit vectors at 0, 36.87, 53.13 and 90 degrees: sims 0.8/0.6/0 from x0, 0.96 between x1 and x2
    x = np.array([[1.0, 0.0], [0.8, 0.6], [0.6, 0.8], [0.0, 1.0]])
    y = np.array([0, 0, 1, 1])
    # q0: [x1+] ; q1: [x2-, x0+] ; q2: [x1-, x3+] ; q3: [x2+]
    res = retrieval_metrics(x, y, ks=(1, 2))
    assert res["recall@1"] == pytest.approx(0.5)
    assert res["recall@2"] == pytest.approx(1.0)
    assert res["map"] == pytest.approx((1 + 0.5 + 0.5 + 1) / 4)
    assert res["map@r"] == pytest.approx(0.5)
    assert res["r_precision"] == pytest.approx(0.5)
    assert res["num_queries"] == 4 and res["num_queries_without_positive"] == 0


def test_map_at_r_counts_only_the_top_r():
    # one query, gallery ranked [pos, neg, pos, neg]: R = 2
    q = np.array([[1.0, 0.0]])
    angles = np.deg2rad([10, 20, 30, 40])
    g = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    res = retrieval_metrics(q, [5], g, [5, 6, 5, 6], ks=(1, 2))
    assert res["map@r"] == pytest.approx(0.5)  # (1/1) / 2: the second positive is outside the top 2
    assert res["map"] == pytest.approx((1 + 2 / 3) / 2)
    assert res["r_precision"] == pytest.approx(0.5)
    assert res["recall@1"] == 1.0


def test_ties_are_resolved_pessimistically():
    q = np.array([[1.0, 0.0]])
    g = np.array([[1.0, 1.0], [1.0, 1.0], [0.0, 1.0]])  # positive tied with a negative
    res = retrieval_metrics(q, [1], g, [1, 2, 1], ks=(1, 2))
    assert res["recall@1"] == 0.0 and res["recall@2"] == 1.0
    assert res["map"] == pytest.approx((1 / 2 + 2 / 3) / 2)


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 5])
def test_exact_duplicates_tie_in_every_block_shape(chunk_size: int | None) -> None:
    """A query's copy among the negatives ties with its copy among the positives whatever block computes
    it: a last block of one row (4,097 queries), small blocks or a gallery of a few items took CPU kernels
    that put the two one bit apart, and the positive often won the tie."""
    rng = np.random.default_rng(0)
    misses = 0
    for n_g in (4098, 4098, 4098, 6, 9, 9):
        v = rng.standard_normal(64).astype(np.float32)
        g = rng.standard_normal((n_g, 64)).astype(np.float32)
        g_labels = rng.integers(2, 50, len(g))
        g[0], g_labels[0] = v, 1  # a negative copy early in the gallery
        g[-1], g_labels[-1] = v, 0  # the positive copy in its last column
        n = 4097 if chunk_size is None else 64
        res = retrieval_metrics(
            np.tile(v, (n, 1)), np.zeros(n, int), g, g_labels, ks=(1, 2), chunk_size=chunk_size
        )
        misses += res["recall@1"] != 0.0 or res["recall@2"] != 1.0
    assert misses == 0


def test_collapsed_embedding_scores_zero_recall_at_1():
    y = np.repeat(np.arange(10), 4)  # 40 items, 3 positives and 36 negatives per query
    res = retrieval_metrics(np.ones((40, 8)), y, ks=(1, 36, 37))
    assert res["recall@1"] == 0.0 and res["recall@36"] == 0.0 and res["recall@37"] == 1.0
    assert res["map@r"] == 0.0 and res["r_precision"] == 0.0
    assert res["map"] == pytest.approx(np.mean([i / (36 + i) for i in (1, 2, 3)]))


def test_perfect_embedding_scores_one():
    y = np.repeat(np.arange(6), [2, 3, 4, 5, 6, 7])
    x = np.eye(6)[y] + 0.01 * np.random.default_rng(0).standard_normal((len(y), 6))
    res = retrieval_metrics(x, y)
    assert all(res[k] == pytest.approx(1.0) for k in ("recall@1", "map", "map@r", "r_precision"))


# -------------------------------------------------------------------------------------- invariances
def test_invariances():
    rng = np.random.default_rng(5)
    x = tied_embeddings(rng, 180, 16, 4)
    y = skewed_labels(rng, 180, 50)
    base = retrieval_metrics(x, y)
    perm = rng.permutation(len(x))
    assert_same(retrieval_metrics(x[perm], y[perm]), base)  # row order
    assert_same(retrieval_metrics(x * rng.uniform(0.1, 9.0, (len(x), 1)), y), base)  # per-row scale
    names = np.array([f"class-{v * 7919}" for v in y])
    assert_same(retrieval_metrics(x, names), base)  # label values (strings, big ids)
    assert_same(retrieval_metrics(torch.from_numpy(x).double(), torch.from_numpy(y)), base)  # input types
    rot, _ = np.linalg.qr(rng.standard_normal((16, 16)))
    assert_same(retrieval_metrics(x @ rot, y), retrieval_metrics((x @ rot).astype(np.float32), y))
    # a gallery copy of the set (each query sees itself once) lifts every metric, never lowers it
    g_res = retrieval_metrics(x, y, x, y)
    assert g_res["recall@1"] >= base["recall@1"] and g_res["map"] >= base["map"]


def test_chunk_size_does_not_change_results():
    rng = np.random.default_rng(9)
    x = tied_embeddings(rng, 240, 32, 16)
    y = skewed_labels(rng, 240, 60)
    results = [retrieval_metrics(x, y, chunk_size=c) for c in (1, 2, 17, 64, 240, 10_000)]
    for r in results[1:]:
        assert r == results[0]


# ---------------------------------------------------------------------------------- queries / inputs
def test_queries_without_positive_are_excluded_and_counted():
    rng = np.random.default_rng(2)
    x = tied_embeddings(rng, 120, 16, 4)
    y = np.concatenate([rng.integers(0, 20, 100), 1000 + np.arange(20)])  # 20 singletons
    res = retrieval_metrics(x, y)
    assert res["num_queries_without_positive"] >= 20
    assert_same(res, brute_force(x, y))
    gal = retrieval_metrics(x[:50], np.arange(50), x[50:], y[50:])
    assert gal["num_queries_without_positive"] + gal["num_queries"] == 50


def test_metrics_do_not_depend_on_the_embeddings_scale():
    """Cosine metrics of rows scaled by 1e20 (a float32 norm overflowed: rows became zeros and tied) or
    1e-23 (the norm underflowed: refused as all zeros) are those at unit scale; the faiss metrics rank by
    cosine too (they ranked raw rows by inner product, so by length as well)."""
    from dmltrain.index import approximate_retrieval_metrics

    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    y = rng.integers(0, 6, 40)
    want = retrieval_metrics(x, y, ks=(1, 2))
    for scale in (1e20, 1e-23):
        got = retrieval_metrics(torch.tensor(x) * scale, y, ks=(1, 2))
        assert got == pytest.approx(want, abs=1e-6), scale
    lengths = rng.uniform(0.1, 10.0, (40, 1)).astype(np.float32)  # far from unit length
    flat = approximate_retrieval_metrics(x * lengths, y, ks=(1, 2), kind="flat", recall_queries=5)
    for key in ("recall@1", "recall@2", "map@r", "r_precision"):
        assert flat[key] == pytest.approx(want[key], abs=1e-6), key


def test_no_query_with_a_positive_is_an_error():
    with pytest.raises(ValueError, match="none of the 5 queries"):
        retrieval_metrics(np.eye(5), np.arange(5))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"query_embeddings": np.array([[1.0, 0], [np.nan, 1], [0, 1]])}, "query_embeddings row 1"),
        ({"query_embeddings": np.array([[1.0, 0], [0, 0], [0, 1]])}, "query_embeddings row 1 is all zeros"),
        ({"query_embeddings": np.ones(3)}, "query_embeddings must be a non-empty 2-D"),
        ({"query_labels": [0, 1]}, "query_labels has 2 entries"),
        ({"query_labels": [0.0, 1.0, 1.0]}, "query_labels must hold integer"),
        ({"gallery_embeddings": np.ones((2, 3)), "gallery_labels": [0, 1]}, "dimension 3"),
        ({"gallery_embeddings": np.ones((2, 2))}, "without gallery_labels"),
        ({"gallery_labels": [0, 1]}, "without gallery_embeddings"),
        ({"gallery_embeddings": np.ones((2, 2)), "gallery_labels": [0, 1, 2]}, "gallery_labels has 3"),
        ({"ks": (0, 1)}, "ks must be positive"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
    ],
)
def test_bad_input_is_refused_with_a_named_field(kwargs, match):
    args = {"query_embeddings": np.array([[1.0, 0], [0.9, 0.1], [0, 1]]), "query_labels": [0, 0, 1]} | kwargs
    with pytest.raises(ValueError, match=match):
        retrieval_metrics(**args)


# ------------------------------------------------------------------------------- nearest neighbours
def test_nearest_neighbors_leave_one_out_and_gallery():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((90, 12)).astype(np.float32)
    xn = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = xn @ xn.T
    np.fill_diagonal(s, -np.inf)
    idx, sims = nearest_neighbors(x, k=5)
    assert idx.shape == sims.shape == (90, 5)
    np.testing.assert_array_equal(idx, np.argsort(-s, axis=1)[:, :5])
    assert (idx != np.arange(90)[:, None]).all()
    np.testing.assert_allclose(sims, np.take_along_axis(s, idx, 1), atol=1e-5)
    # a few queries drawn from the set itself, searched in the whole set, skipping themselves
    pick = np.array([3, 40, 77])
    idx2, _ = nearest_neighbors(x[pick], x, k=5, self_indices=pick, chunk_size=2)
    np.testing.assert_array_equal(idx2, idx[pick])
    # plain gallery search keeps the query's own copy; k is capped by the gallery size
    idx3, sims3 = nearest_neighbors(x[pick], x[:10], k=50)
    assert idx3.shape == (3, 10) and (np.diff(sims3, axis=1) <= 1e-6).all()
    with pytest.raises(ValueError, match="self_indices"):
        nearest_neighbors(x, k=3, self_indices=np.arange(90))


# ----------------------------------------------------------------------------------------- protocols
def test_leave_one_out_and_query_gallery_protocols():
    rng = np.random.default_rng(8)
    x = tied_embeddings(rng, 200, 16, 4)
    y = rng.integers(0, 40, 200)
    sop = evaluate_protocol(x, y, "sop", prefix="test/")
    assert set(sop) == {f"test/recall@{k}" for k in PROTOCOL_DEFAULT_KS["sop"]} | {
        "test/map",
        "test/map@r",
        "test/r_precision",
        "test/num_queries",
        "test/num_queries_without_positive",
    }
    assert sop["test/map@r"] == retrieval_metrics(x, y)["map@r"]
    qmask = np.arange(200) % 3 == 0
    gmask = ~qmask
    shop = evaluate_protocol(torch.from_numpy(x), y, "inshop", query_mask=qmask, gallery_mask=gmask)
    assert_same(
        shop, retrieval_metrics(x[qmask], y[qmask], x[gmask], y[gmask], PROTOCOL_DEFAULT_KS["inshop"])
    )
    same = evaluate_protocol(
        x, y, "query_gallery", query_mask=np.flatnonzero(qmask), gallery_mask=gmask, ks=KS
    )
    assert same["recall@1"] == shop["recall@1"]
    with pytest.raises(ValueError, match="share row 0"):
        evaluate_protocol(x, y, "inshop", query_mask=qmask, gallery_mask=np.ones(200, bool))
    with pytest.raises(ValueError, match="needs query_mask"):
        evaluate_protocol(x, y, "inshop")
    with pytest.raises(ValueError, match="unknown protocol"):
        evaluate_protocol(x, y, "imagenet")


def test_vehicleid_protocol_both_galleries():
    rng = np.random.default_rng(6)
    x = tied_embeddings(rng, 300, 32, 16)
    y = rng.integers(0, 60, 300)
    sets = {"small": np.arange(100), "medium": np.arange(200), "large": np.ones(300, bool)}
    loo = evaluate_protocol(x, y, "vehicleid", test_sets=sets)
    assert loo["small/recall@5"] == retrieval_metrics(x[:100], y[:100], ks=(1, 5))["recall@5"]
    assert loo["large/map"] == retrieval_metrics(x, y, ks=(1, 5))["map"]
    one = evaluate_protocol(
        x, y, "vehicleid", test_sets=sets, vehicleid_gallery="one_per_class", num_repeats=3
    )
    for name in sets:
        # a single relevant gallery image per query: MAP@R, R-precision and Recall@1 coincide
        assert one[f"{name}/map@r"] == pytest.approx(one[f"{name}/recall@1"])
        assert one[f"{name}/r_precision"] == pytest.approx(one[f"{name}/recall@1"])
    again = evaluate_protocol(
        x, y, "vehicleid", test_sets=sets, vehicleid_gallery="one_per_class", num_repeats=3
    )
    assert again == one
    other = evaluate_protocol(
        x, y, "vehicleid", test_sets=sets, vehicleid_gallery="one_per_class", num_repeats=3, seed=1
    )
    assert other != one
    with pytest.raises(ValueError, match="needs test_sets"):
        evaluate_protocol(x, y, "vehicleid")


def test_vehicleid_gallery_split_takes_one_image_per_class():
    y = np.repeat(np.arange(30), np.arange(1, 31))
    qs, gs = vehicleid_gallery_split(y, seed=3)
    assert len(gs) == 30 and sorted(y[gs].tolist()) == list(range(30))
    assert len(np.intersect1d(qs, gs)) == 0 and len(qs) + len(gs) == len(y)
    _, gs2 = vehicleid_gallery_split(y, seed=4)
    assert not np.array_equal(gs, gs2)
    np.testing.assert_array_equal(vehicleid_gallery_split(y, seed=3)[1], gs)
