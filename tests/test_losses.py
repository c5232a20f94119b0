"""Ranking losses against float64 loop references written from the papers' equations, plus properties.

References (below) follow: FastAP paper Eq. 14 with supplement C.1 soft binning (L+1 centres, width 4/L);
Smooth-AP Eq. 5-7 (query excluded from its retrieval and positive sets); RLL Eq. 8-14 with detached
weights (and, for the Sec. 3.2 form, detached gallery features); Deep Ranking Eq. 1 averaged over active
triplets, and Eq. 8 over the sampled triplets. They loop over queries and items one scalar at
a time so that they share no code or vectorisation trick with dmltrain.losses.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dmltrain.losses import (
    FastAPLoss,
    LevelwiseLoss,
    LossParts,
    RankedListLoss,
    RankingLoss,
    SmoothAPLoss,
    TnSchedule,
    TripletLoss,
)

# --------------------------------------------------------------------------------------------------------
# float64 references: plain loops straight from the equations
# --------------------------------------------------------------------------------------------------------


def _retrieval_sets(q_labels, r_labels, self_rows, q):
    items = [j for j in range(len(r_labels)) if j != self_rows[q]]
    pos = [j for j in items if r_labels[j] == q_labels[q]]
    neg = [j for j in items if r_labels[j] != q_labels[q]]
    return items, pos, neg


def ref_fastap_terms(x, y, r, ry, self_rows, num_bins):
    """Per-query 1 - FastAP_q (None for queries without positives)."""
    delta = 4.0 / num_bins
    centres = [l * delta for l in range(num_bins + 1)]
    terms = []
    for q in range(x.shape[0]):
        items, pos, _ = _retrieval_sets(y, ry, self_rows, q)
        if not pos:
            terms.append(None)
            continue
        dist = {j: 2.0 - 2.0 * torch.dot(x[q], r[j]) for j in items}
        h = [sum(torch.relu(1.0 - torch.abs(dist[j] - c) / delta) for j in items) for c in centres]
        hp = [sum(torch.relu(1.0 - torch.abs(dist[j] - c) / delta) for j in pos) for c in centres]
        fast_ap, cum, cum_pos = 0.0, 0.0, 0.0
        for l in range(num_bins + 1):
            cum = cum + h[l]
            cum_pos = cum_pos + hp[l]
            if cum.item() > 0:
                fast_ap = fast_ap + hp[l] * cum_pos / cum
        terms.append(1.0 - fast_ap / len(pos))
    return terms


def ref_smoothap_terms(x, y, r, ry, self_rows, tau):
    """Per-query 1 - AP_q of Smooth-AP Eq. 5 with the sigmoid (None without positives)."""
    terms = []
    for q in range(x.shape[0]):
        items, pos, _ = _retrieval_sets(y, ry, self_rows, q)
        if not pos:
            terms.append(None)
            continue
        s = {j: torch.dot(x[q], r[j]) for j in items}
        ap = 0.0
        for i in pos:
            rank_pos = 1.0 + sum(torch.sigmoid((s[j] - s[i]) / tau) for j in pos if j != i)
            rank_all = 1.0 + sum(torch.sigmoid((s[j] - s[i]) / tau) for j in items if j != i)
            ap = ap + rank_pos / rank_all
        terms.append(1.0 - ap / len(pos))
    return terms


def ref_rll_terms(x, y, r, ry, self_rows, margin, alpha, tn, tp, lam):
    """Per-query L_RLL (Eq. 13) with weights computed from detached distances."""
    alpha = 1.0 + margin / 2.0 if alpha is None else alpha
    terms = []
    for q in range(x.shape[0]):
        _, pos, neg = _retrieval_sets(y, ry, self_rows, q)
        d = {j: torch.linalg.vector_norm(x[q] - r[j]) for j in pos + neg}
        p_star = [j for j in pos if d[j].item() > alpha - margin]
        n_star = [j for j in neg if d[j].item() < alpha]
        loss_p, loss_n = 0.0, 0.0
        if p_star:
            w = {j: math.exp(tp * (d[j].item() - (alpha - margin))) for j in p_star}
            z = sum(w.values())
            loss_p = sum(w[j] / z * (d[j] - (alpha - margin)) for j in p_star)
        if n_star:
            w = {j: math.exp(tn * (alpha - d[j].item())) for j in n_star}
            z = sum(w.values())
            loss_n = sum(w[j] / z * (alpha - d[j]) for j in n_star)
        terms.append((1.0 - lam) * loss_p + lam * loss_n)
    return terms


def ref_triplet(x, y, r, ry, self_rows, margin):
    """(sum of active hinges, number of active triplets)."""
    total, count = 0.0, 0
    for a in range(x.shape[0]):
        _, pos, neg = _retrieval_sets(y, ry, self_rows, a)
        for p in pos:
            for n in neg:
                hinge = margin + torch.sum((x[a] - r[p]) ** 2) - torch.sum((x[a] - r[n]) ** 2)
                if hinge.item() > 0:
                    total, count = total + hinge, count + 1
    return total, count


def ref_sampled_triplet(x, r, self_rows, margin):
    """Deep Ranking Eq. 8 over the sampled triplets (rows 3i, 3i+1, 3i+2 of r) whose anchor is a query,
    divided by their number."""
    total, count = x.sum() * 0.0, 0
    for q in range(x.shape[0]):
        row = self_rows[q]
        if row % 3 == 0:
            d_ap = sum((x[q, k] - r[row + 1, k]) ** 2 for k in range(x.shape[1]))
            d_an = sum((x[q, k] - r[row + 2, k]) ** 2 for k in range(x.shape[1]))
            total, count = total + torch.clamp(margin + d_ap - d_an, min=0.0), count + 1
    return total / max(count, 1)


def ref_mean(kind, params, x, y, r=None, ry=None, self_rows=None):
    """Whole-batch mean loss of a reference (defaults: in-batch retrieval)."""
    if r is None:
        r, ry, self_rows = x, y, list(range(x.shape[0]))
    y, ry = y.tolist(), ry.tolist()
    if self_rows is None:
        self_rows = [-1] * x.shape[0]
    if kind == "triplet":
        total, count = ref_triplet(x, y, r, ry, self_rows, **params)
        return total / count if count else x.sum() * 0.0
    fn = {"fastap": ref_fastap_terms, "smoothap": ref_smoothap_terms, "rll": ref_rll_terms}[kind]
    terms = fn(x, y, r, ry, self_rows, **params)
    if kind == "rll":
        return sum(terms) / len(terms)
    valid = [t for t in terms if t is not None]
    return sum(valid) / len(valid) if valid else x.sum() * 0.0


def exact_ap(sims, is_pos):
    """AP by sorting (ties impossible for random data): mean over positives of precision at their rank."""
    order = sorted(range(len(sims)), key=lambda j: -sims[j])
    hits, total = 0, 0.0
    for rank, j in enumerate(order, start=1):
        if is_pos[j]:
            hits += 1
            total += hits / rank
    return total / hits


# --------------------------------------------------------------------------------------------------------
# fixtures and helpers
# --------------------------------------------------------------------------------------------------------

CASES = [
    ("fastap", {"num_bins": 10}),
    ("fastap", {"num_bins": 4}),
    ("smoothap", {"tau": 0.01}),
    ("smoothap", {"tau": 0.1}),
    ("rll", {"margin": 0.4, "alpha": None, "tn": 10.0, "tp": 0.0, "lam": 0.5}),
    ("rll", {"margin": 0.3, "alpha": 1.3, "tn": 4.0, "tp": -2.0, "lam": 0.3}),
    ("rll", {"margin": 0.5, "alpha": 1.2, "tn": 80.0, "tp": 30.0, "lam": 0.6}),  # near-hardest mining
    ("rll", {"margin": 0.2, "alpha": None, "tn": -30.0, "tp": 5.0, "lam": 0.5}),  # easy negatives first
    ("triplet", {"margin": 0.2}),
    ("triplet", {"margin": 1.0}),
]


def make_loss(kind: str, params: dict, **kw) -> RankingLoss:
    if kind == "fastap":
        return FastAPLoss(num_bins=params["num_bins"], **kw)
    if kind == "smoothap":
        return SmoothAPLoss(temperature=params["tau"], **kw)
    if kind == "rll":
        return RankedListLoss(**params, **kw)
    return TripletLoss(margin=params["margin"], **kw)


def case_id(case) -> str:
    return case[0] + "-" + "-".join(f"{k}{v}" for k, v in case[1].items())


def unequal_batch(seed: int, dim: int = 6, dtype=torch.float64):
    """Unequal classes (5, 4, 3, 2, 1 and 1 singleton more), arbitrary label values, shuffled order."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.tensor([907] * 5 + [-3] * 4 + [12] * 3 + [5] * 2 + [77] + [40])
    labels = labels[torch.randperm(labels.numel(), generator=g)]
    centres = {int(c): torch.randn(dim, generator=g, dtype=torch.float64) for c in labels.unique()}
    x = torch.stack(
        [centres[int(c)] + 0.9 * torch.randn(dim, generator=g, dtype=torch.float64) for c in labels]
    )
    return F.normalize(x, dim=1).to(dtype), labels


def loss_and_grad(loss_fn, x, y, **kw):
    x = x.detach().clone().requires_grad_(True)
    value = loss_fn(x, y, **kw)
    value.backward()
    return value.detach(), x.grad


# --------------------------------------------------------------------------------------------------------
# agreement with the references
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_float32_value_and_gradient_match_float64_reference(case):
    kind, params = case
    x64, y = unequal_batch(seed=1)
    ref_x = x64.clone().requires_grad_(True)
    ref_value = ref_mean(kind, params, ref_x, y)
    ref_value.backward()
    value, grad = loss_and_grad(make_loss(kind, params), x64.float(), y)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(ref_value.item(), rel=1e-5, abs=1e-6)
    scale = ref_x.grad.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(grad.double(), ref_x.grad, rtol=1e-4, atol=2e-5 * scale)


@pytest.mark.parametrize("kind", ["fastap", "smoothap", "rll", "triplet"])
def test_small_class_with_the_largest_label_next_to_a_big_class(kind):
    """Regression: padded positive lists of the last class in label order once overwrote gradients."""
    params = dict(next(p for k, p in CASES if k == kind))
    g = torch.Generator().manual_seed(19)
    y = torch.tensor([1] * 6 + [2] * 2 + [9] * 2 + [5])
    y = y[torch.randperm(y.numel(), generator=g)]
    x = F.normalize(torch.randn(y.numel(), 5, generator=g, dtype=torch.float64), dim=1)
    ref_x = x.clone().requires_grad_(True)
    ref_mean(kind, params, ref_x, y).backward()
    _, grad = loss_and_grad(make_loss(kind, params), x, y)
    torch.testing.assert_close(grad, ref_x.grad, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("num_bins", [10, 4])
def test_fastap_matches_reference_for_non_normalised_embeddings(num_bins):
    """Norms off 1 put distances below 0 and above 4, i.e. on the outer halves of the end triangles."""
    g = torch.Generator().manual_seed(20)
    x, y = unequal_batch(seed=20)
    x = x * (0.85 + 0.35 * torch.rand(x.shape[0], 1, generator=g, dtype=torch.float64))
    # a longer copy of row 0 (same class) and two near-antipodes of rows 1 and 2 (a new class)
    x = torch.cat([x, 1.12 * x[:1] / x[0].norm(), -1.1 * x[1:3] / x[1:3].norm(dim=1, keepdim=True)])
    y = torch.cat([y, y[:1], torch.tensor([555, 555])])
    dist = (2 - 2 * x @ x.T).fill_diagonal_(2.0)
    assert dist.min() < -0.2 and dist.max() > 4.1  # both outer tails are exercised
    ref_x = x.clone().requires_grad_(True)
    ref_mean("fastap", {"num_bins": num_bins}, ref_x, y).backward()
    value, grad = loss_and_grad(FastAPLoss(num_bins=num_bins), x, y)
    expected = ref_mean("fastap", {"num_bins": num_bins}, x, y)
    assert value.item() == pytest.approx(expected.item(), rel=1e-10)
    torch.testing.assert_close(grad, ref_x.grad, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_float64_matches_reference_tightly_with_explicit_gallery(case):
    """Queries scored against a gallery that holds their own rows (excluded via query_index) or not."""
    kind, params = case
    x, y = unequal_batch(seed=2)
    gal, gal_y = unequal_batch(seed=3)
    queries, q_y = x[:6], y[:6]
    qidx = torch.arange(gal.shape[0], gal.shape[0] + 6)
    loss_fn = make_loss(kind, params)
    with_self = (torch.cat([gal, queries]), torch.cat([gal_y, q_y]), qidx.tolist(), {"query_index": qidx})
    for ref, ref_y, self_rows, kw in (with_self, (gal, gal_y, None, {})):
        qq = queries.clone().requires_grad_(True)
        rr = ref.clone().requires_grad_(True)
        ours = loss_fn(qq, q_y, ref_embeddings=rr, ref_labels=ref_y, **kw)
        ours.backward()
        q2 = queries.clone().requires_grad_(True)
        r2 = ref.clone().requires_grad_(True)
        expected = ref_mean(kind, params, q2, q_y, r2, ref_y, self_rows)
        expected.backward()
        assert ours.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
        torch.testing.assert_close(qq.grad, q2.grad, rtol=1e-8, atol=1e-10)
        torch.testing.assert_close(rr.grad, r2.grad, rtol=1e-8, atol=1e-10)


GRADCHECK_CASES = [
    ("fastap", {"num_bins": 10}),
    ("smoothap", {"tau": 0.05}),
    # RLL's weights are constants for the gradient by design, so gradcheck (finite differences of the value)
    # applies when they are constant: Tn = Tp = 0. Tn != 0 is checked against the reference above.
    ("rll", {"margin": 0.4, "alpha": None, "tn": 0.0, "tp": 0.0, "lam": 0.5}),
    ("triplet", {"margin": 0.3}),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=case_id)
def test_gradcheck_float64(case):
    kind, params = case
    x, y = unequal_batch(seed=4, dim=4)
    x = x[:10].clone().requires_grad_(True)
    y = y[:10]
    loss_fn = make_loss(kind, params)
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, y), (x,), eps=1e-6, atol=1e-6)
    # and through the explicit-gallery path: separate query and reference tensors
    ref = x.detach()[:, :].clone().requires_grad_(True)
    q = x.detach()[:4].clone().requires_grad_(True)
    qi = torch.arange(4)
    assert torch.autograd.gradcheck(
        lambda a, b: loss_fn(a, y[:4], ref_embeddings=b, ref_labels=y, query_index=qi, reduction="sum"),
        (q, ref),
        eps=1e-6,
        atol=1e-6,
    )


def test_fastap_and_triplet_agree_with_pytorch_metric_learning():
    """An independent implementation (PML 2.9.0) of the same definitions; it normalises internally."""
    from pytorch_metric_learning import distances, losses

    g = torch.Generator().manual_seed(5)
    raw = torch.randn(24, 8, generator=g)
    y = torch.arange(6).repeat_interleave(4)
    y = y[torch.randperm(24, generator=g)]
    pml_pairs = [
        (FastAPLoss(num_bins=10), losses.FastAPLoss(num_bins=10)),
        (
            TripletLoss(margin=0.2),
            losses.TripletMarginLoss(margin=0.2, distance=distances.LpDistance(power=2)),
        ),
    ]
    for ours, theirs in pml_pairs:
        a = raw.clone().requires_grad_(True)
        la = ours(F.normalize(a, dim=1), y)
        la.backward()
        b = raw.clone().requires_grad_(True)
        lb = theirs(b, y)
        lb.backward()
        assert la.item() == pytest.approx(lb.item(), rel=1e-5)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------------
# the paper forms: sampled triplets (Deep Ranking Eq. 8) and RLL with constant gallery features (Sec. 3.2)
# --------------------------------------------------------------------------------------------------------


def triplet_batch(seed: int, triplets: int = 7, dim: int = 6, dtype=torch.float64):
    """[q, p, n] rows as the triplet sampler emits them; classes repeat across triplets (so the in-batch
    "all" form sees many more triplets than were sampled)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 4, (triplets,), generator=g)
    n = (q + torch.randint(1, 4, (triplets,), generator=g)) % 4
    labels = torch.stack([q, q, n], dim=1).flatten() * 11 - 5
    centres = torch.randn(4, dim, generator=g, dtype=torch.float64)
    x = centres[(labels + 5) // 11] + 0.8 * torch.randn(labels.numel(), dim, generator=g, dtype=torch.float64)
    return F.normalize(x, dim=1).to(dtype), labels


@pytest.mark.parametrize("margin", [0.2, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sampled_triplets_match_eq8_reference(margin, dtype):
    x, y = triplet_batch(seed=30, dtype=dtype)
    ref_x = x.double().clone().requires_grad_(True)
    expected = ref_sampled_triplet(ref_x, ref_x, list(range(x.shape[0])), margin)
    expected.backward()
    loss_fn = TripletLoss(margin=margin, triplets="sampled")
    value, grad = loss_and_grad(loss_fn, x, y)
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
    assert value.dtype == dtype
    assert value.item() == pytest.approx(expected.item(), rel=tol["rtol"], abs=tol["atol"])
    assert ref_x.grad.abs().max() > 0
    torch.testing.assert_close(grad.double(), ref_x.grad, rtol=10 * tol["rtol"], atol=10 * tol["atol"])
    # the sampled form is not the all-triplets form on the same batch: the sampler's choices matter
    assert abs(TripletLoss(margin=margin)(x, y).item() - value.item()) > 1e-3
    parts = loss_fn.parts(x, y)
    assert parts.count.item() == x.shape[0] // 3 and parts.num_queries == x.shape[0]
    terms = loss_fn(x, y, reduction="none")
    assert torch.all(terms[1::3] == 0) and torch.all(terms[2::3] == 0)
    assert parts.num_valid == int((terms[0::3] > 0).sum()) > 0


def test_sampled_triplets_with_a_gallery_and_row_split_match_the_whole_batch():
    """Queries are any rows of the (global) batch; a split may cut triplets, as uneven ranks do."""
    x, y = triplet_batch(seed=31, triplets=8)
    loss_fn = TripletLoss(margin=0.3, triplets="sampled")
    whole, whole_grad = loss_and_grad(loss_fn, x, y)
    for idx in (torch.arange(0, 7), torch.tensor([23, 4, 9, 0, 13])):
        q = x[idx].clone().requires_grad_(True)
        r = x.clone().requires_grad_(True)
        ours = loss_fn(q, y[idx], ref_embeddings=r, ref_labels=y, query_index=idx)
        ours.backward()
        q2, r2 = x[idx].clone().requires_grad_(True), x.clone().requires_grad_(True)
        expected = ref_sampled_triplet(q2, r2, idx.tolist(), 0.3)
        expected.backward()
        assert ours.item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
        torch.testing.assert_close(q.grad, q2.grad, rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(r.grad, r2.grad, rtol=1e-8, atol=1e-12)
    xr = x.clone().requires_grad_(True)
    halves = (torch.arange(0, 11), torch.arange(11, 24))  # row 9's triplet straddles the split
    parts = [loss_fn.parts(xr[h], y[h], ref_embeddings=xr, ref_labels=y, query_index=h) for h in halves]
    split = sum(p.total for p in parts) / sum(p.count for p in parts)
    split.backward()
    torch.testing.assert_close(split.detach(), whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(xr.grad, whole_grad, rtol=1e-10, atol=1e-14)


def test_sampled_triplets_gradcheck_float64():
    x, y = triplet_batch(seed=32, triplets=4, dim=4)
    loss_fn = TripletLoss(margin=0.5, triplets="sampled")
    x = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, y), (x,), eps=1e-6, atol=1e-6)


def test_sampled_triplets_refuse_batches_not_in_the_sampler_layout():
    x, y = triplet_batch(seed=33)
    loss_fn = TripletLoss(triplets="sampled")
    with pytest.raises(ValueError, match="not a multiple of 3"):
        loss_fn(x[:-1], y[:-1])
    broken = y.clone()
    broken[4] = broken[3] + 1  # the positive of triplet 1 is not of the query's class
    with pytest.raises(ValueError, match=r"rows 3\.\.5 are not a \(query, positive, negative\) triplet"):
        loss_fn(x, broken)
    same = y.clone()
    same[2] = same[0]  # a "negative" of the query's class
    with pytest.raises(ValueError, match="rows 0..2"):
        loss_fn(x, same)
    with pytest.raises(ValueError, match="needs query_index"):
        loss_fn(x[:3], y[:3], ref_embeddings=x, ref_labels=y)
    with pytest.raises(ValueError, match="triplets must be one of"):
        TripletLoss(triplets="hard")


def test_rll_query_gradient_is_the_paper_form_with_constant_gallery_features():
    """Sec. 3.2: in x_i's ranked list the other features are constants; only f(x_i) moves."""
    params = {"margin": 0.4, "alpha": None, "tn": 10.0, "tp": 0.0, "lam": 0.5}
    x, y = unequal_batch(seed=34)
    ref_x = x.clone().requires_grad_(True)
    terms = ref_rll_terms(ref_x, y.tolist(), ref_x.detach(), y.tolist(), list(range(len(y))), **params)
    expected = sum(terms) / len(terms)
    expected.backward()
    loss_fn = RankedListLoss(**params, gradient="query")
    value, grad = loss_and_grad(loss_fn, x, y)
    assert value.item() == pytest.approx(expected.item(), rel=1e-12)
    torch.testing.assert_close(grad, ref_x.grad, rtol=1e-8, atol=1e-12)
    # same value as the default form, different gradient (the default also moves the gallery items)
    both_value, both_grad = loss_and_grad(RankedListLoss(**params), x, y)
    assert both_value.item() == pytest.approx(value.item(), rel=1e-12)
    assert (both_grad - grad).abs().max() > 1e-3
    # with an explicit gallery the gallery gets no gradient at all; the queries still do
    q = x[:5].clone().requires_grad_(True)
    r = x.clone().requires_grad_(True)
    loss_fn(q, y[:5], ref_embeddings=r, ref_labels=y, query_index=torch.arange(5)).backward()
    assert r.grad is None and torch.count_nonzero(q.grad.abs().sum(1)) == 5
    assert loss_fn.gallery_is_constant and not RankedListLoss().gallery_is_constant
    # a multi-level embedding keeps the base's answer (the engine read False and all-reduced the gallery)
    assert (
        LevelwiseLoss(loss_fn, 3).gallery_is_constant
        and not LevelwiseLoss(RankedListLoss(), 3).gallery_is_constant
    )
    with pytest.raises(ValueError, match="gradient must be one of"):
        RankedListLoss(gradient="gallery")


# --------------------------------------------------------------------------------------------------------
# the distributed contract: row split, parts, reductions
# --------------------------------------------------------------------------------------------------------

ALL_LOSSES = [
    FastAPLoss(),
    SmoothAPLoss(temperature=0.05),
    RankedListLoss(),
    RankedListLoss(margin=0.3, alpha=1.1, tn=2.0, tp=1.0, lam=0.7),
    RankedListLoss(gradient="query"),
    TripletLoss(),
]


@pytest.mark.parametrize("loss_fn", ALL_LOSSES, ids=lambda f: type(f).__name__)
def test_row_split_parts_sum_to_whole_batch_loss_and_gradient(loss_fn):
    g = torch.Generator().manual_seed(6)
    x0, y = unequal_batch(seed=6, dim=8, dtype=torch.float32)
    x0 = torch.cat([x0, F.normalize(torch.randn(9, 8, generator=g), dim=1)])
    y = torch.cat([y, torch.tensor([907, 907, 3, 3, 3, -3, 40, 8, 8])])
    whole, whole_grad = loss_and_grad(loss_fn, x0, y)

    x = x0.clone().requires_grad_(True)
    perm = torch.randperm(x.shape[0], generator=g)
    halves = (perm[:11], perm[11:])  # arbitrary, interleaved query subsets
    parts = [loss_fn.parts(x[idx], y[idx], ref_embeddings=x, ref_labels=y, query_index=idx) for idx in halves]
    assert all(isinstance(p, LossParts) for p in parts)
    count = sum(p.count for p in parts)
    split = sum(p.total for p in parts) / count.clamp(min=1)
    split.backward()
    torch.testing.assert_close(split.detach(), whole, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad, whole_grad, rtol=1e-4, atol=1e-6)
    assert sum(p.num_queries for p in parts) == x.shape[0]
    assert parts[0].count.requires_grad is False
    assert parts[0].total.dtype == torch.float32


@pytest.mark.parametrize("loss_fn", ALL_LOSSES, ids=lambda f: type(f).__name__)
def test_reductions_and_parts_are_consistent(loss_fn):
    x, y = unequal_batch(seed=7, dtype=torch.float32)
    terms = loss_fn(x, y, reduction="none")
    parts = loss_fn.parts(x, y)
    assert terms.shape == (x.shape[0],)
    torch.testing.assert_close(loss_fn(x, y, reduction="sum"), terms.sum())
    torch.testing.assert_close(loss_fn(x, y), terms.sum() / parts.count)
    torch.testing.assert_close(parts.mean(), loss_fn(x, y))
    assert 0 < parts.num_valid <= parts.num_queries == x.shape[0]


def test_counts_and_valid_queries_follow_each_definition():
    x, y = unequal_batch(seed=8, dtype=torch.float32)  # two singletons: 77 and 40
    for loss_fn in (FastAPLoss(), SmoothAPLoss()):
        parts = loss_fn.parts(x, y)
        assert parts.count.item() == parts.num_valid == x.shape[0] - 2
        terms = loss_fn(x, y, reduction="none")
        singles = (y == 77) | (y == 40)
        assert torch.all(terms[singles] == 0)
    assert RankedListLoss().parts(x, y).count.item() == x.shape[0]
    xd = x.double()
    _, n_active = ref_triplet(xd, y.tolist(), xd, y.tolist(), list(range(len(y))), 0.2)
    assert TripletLoss(margin=0.2).parts(x, y).count.item() == n_active


# --------------------------------------------------------------------------------------------------------
# invariances and limits
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", ALL_LOSSES, ids=lambda f: type(f).__name__)
def test_invariant_to_batch_order_and_label_names(loss_fn):
    x, y = unequal_batch(seed=9, dtype=torch.float32)
    base, base_grad = loss_and_grad(loss_fn, x, y)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    permuted, permuted_grad = loss_and_grad(loss_fn, x[perm], y[perm])
    torch.testing.assert_close(permuted, base, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(permuted_grad, base_grad[perm], rtol=1e-4, atol=1e-6)
    renamed = {int(v): 10_000_000_000 - 7 * i for i, v in enumerate(y.unique().flip(0))}
    y2 = torch.tensor([renamed[int(v)] for v in y])
    renamed_value, renamed_grad = loss_and_grad(loss_fn, x, y2)
    torch.testing.assert_close(renamed_value, base)
    torch.testing.assert_close(renamed_grad, base_grad)


def test_smoothap_at_tiny_temperature_is_exact_ap():
    x, y = unequal_batch(seed=10, dim=5)
    terms = SmoothAPLoss(temperature=1e-6)(x, y, reduction="none")
    sims = x @ x.T
    for q in range(x.shape[0]):
        others = [j for j in range(x.shape[0]) if j != q]
        is_pos = [bool(y[j] == y[q]) for j in others]
        if not any(is_pos):
            continue
        ap = exact_ap([float(sims[q, j]) for j in others], is_pos)
        assert 1 - terms[q].item() == pytest.approx(ap, abs=1e-9)
    # and the smooth version differs from the exact one at the paper's temperature
    assert not torch.allclose(SmoothAPLoss(temperature=0.5)(x, y, reduction="none"), terms)


def test_perfectly_separated_batch_gives_fastap_one_and_smoothap_near_zero():
    g = torch.Generator().manual_seed(11)
    labels = torch.tensor([3, 3, 3, 8, 8, 1, 1, 1, 1, 6, 6])
    dim = 16
    basis = torch.eye(dim)
    # one orthogonal direction per class, tiny within-class jitter: positives at d ~ 0, negatives at d ~ 2
    x = torch.stack([basis[int(c) % dim] + 0.01 * torch.randn(dim, generator=g) for c in labels])
    x = F.normalize(x, dim=1).requires_grad_(True)
    fastap = FastAPLoss(num_bins=10)(x, labels)
    assert fastap.item() == pytest.approx(0.0, abs=1e-6)
    smooth = SmoothAPLoss(temperature=0.01)(x, labels)
    assert 0.0 <= smooth.item() < 1e-6
    # the same batch with classes mixed up is far from perfect
    assert FastAPLoss()(x, labels.roll(1)).item() > 0.3


def test_queries_without_negatives_have_ap_one():
    x, _ = unequal_batch(seed=12, dtype=torch.float32)
    same = torch.zeros(x.shape[0], dtype=torch.int64)
    for loss_fn in (FastAPLoss(), SmoothAPLoss()):
        value, grad = loss_and_grad(loss_fn, x, same)
        assert value.item() == pytest.approx(0.0, abs=1e-6)
        assert loss_fn.parts(x, same).num_valid == x.shape[0]
    value, grad = loss_and_grad(TripletLoss(), x, same)
    assert value.item() == 0.0 and torch.count_nonzero(grad) == 0
    rll = RankedListLoss()(x, same, reduction="none")
    xd, ys, rows = x.double(), same.tolist(), list(range(x.shape[0]))
    params = {"margin": 0.4, "alpha": None, "tn": 10.0, "tp": 0.0, "lam": 0.5}
    expected = torch.stack([torch.as_tensor(t) for t in ref_rll_terms(xd, ys, xd, ys, rows, **params)])
    torch.testing.assert_close(rll.double(), expected.double(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_fn", ALL_LOSSES, ids=lambda f: type(f).__name__)
def test_batch_without_any_valid_query_is_zero_with_zero_gradient(loss_fn):
    x, _ = unequal_batch(seed=13, dtype=torch.float32)
    if isinstance(loss_fn, RankedListLoss):
        # every RLL query with a negative carries a signal; no signal means nothing to retrieve at all
        x, distinct = x[:1], torch.tensor([5])
    else:
        distinct = torch.arange(x.shape[0]) * 3 - 20  # all singletons: no positives anywhere
    xr = x.clone().requires_grad_(True)
    parts = loss_fn.parts(xr, distinct)
    assert parts.num_valid == 0
    value = loss_fn(xr, distinct)
    value.backward()
    assert value.item() == 0.0 and torch.isfinite(value)
    assert xr.grad is not None and torch.count_nonzero(xr.grad) == 0
    assert parts.mean().item() == 0.0


@pytest.mark.parametrize("kind", ["fastap", "smoothap", "rll", "triplet"])
def test_duplicate_embeddings_with_different_labels_stay_finite_and_match_reference(kind):
    """Coincident points (distance exactly 0): a measure-zero kink, but common with duplicate images."""
    params = dict(next(p for k, p in CASES if k == kind))
    x, y = unequal_batch(seed=21)
    x = torch.cat([x, x[:2], x[4:5]])
    y = torch.cat(
        [y, torch.tensor([1234, 1234]), y[4:5]]
    )  # two copies under a new label, one same-label copy
    value, grad = loss_and_grad(make_loss(kind, params), x.float(), y)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    if kind in ("rll", "triplet"):  # no kink at distance 0 for these (RLL: zero gradient by convention)
        ref_x = x.clone().requires_grad_(True)
        expected = ref_mean(kind, params, ref_x, y)
        expected.backward()
        assert value.item() == pytest.approx(expected.item(), rel=1e-5)
        torch.testing.assert_close(grad.double(), ref_x.grad, rtol=1e-4, atol=1e-5)


def test_empty_batch_is_zero():
    x = torch.zeros(0, 8, requires_grad=True)
    for loss_fn in ALL_LOSSES:
        parts = loss_fn.parts(x, torch.zeros(0, dtype=torch.int64))
        assert parts.num_queries == 0 and parts.mean().item() == 0.0


# --------------------------------------------------------------------------------------------------------
# precision, blocking, determinism
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("loss_fn", ALL_LOSSES, ids=lambda f: type(f).__name__)
def test_half_precision_inputs_are_computed_in_float32(loss_fn, dtype):
    x, y = unequal_batch(seed=14, dim=16, dtype=torch.float32)
    half = x.to(dtype).requires_grad_(True)
    value = loss_fn(half, y)
    value.backward()
    assert value.dtype == torch.float32
    assert half.grad.dtype == dtype and torch.isfinite(half.grad.float()).all()
    expected, expected_grad = loss_and_grad(loss_fn, half.detach().float(), y)
    assert value.item() == pytest.approx(expected.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(half.grad, expected_grad.to(dtype))


@pytest.mark.parametrize("loss_fn", ALL_LOSSES, ids=lambda f: type(f).__name__)
def test_tiny_memory_budget_gives_same_result_and_runs_are_bitwise_deterministic(loss_fn):
    """A budget of a few kB forces one-query blocks and splits a big class's positives into chunks."""
    g = torch.Generator().manual_seed(15)
    y = torch.cat([torch.zeros(90, dtype=torch.int64), torch.arange(1, 31).repeat_interleave(3)])
    x = F.normalize(torch.randn(y.numel(), 12, generator=g), dim=1)
    value, grad = loss_and_grad(loss_fn, x, y)
    again, grad_again = loss_and_grad(loss_fn, x, y)
    assert torch.equal(value, again) and torch.equal(grad, grad_again)
    tiny = type(loss_fn)(**_hyper(loss_fn), memory_budget_mb=0.02)
    value_tiny, grad_tiny = loss_and_grad(tiny, x, y)
    torch.testing.assert_close(value_tiny, value, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad_tiny, grad, rtol=1e-4, atol=1e-6)


def _hyper(loss_fn: RankingLoss) -> dict:
    if isinstance(loss_fn, FastAPLoss):
        return {"num_bins": loss_fn.num_bins}
    if isinstance(loss_fn, SmoothAPLoss):
        return {"temperature": loss_fn.temperature}
    if isinstance(loss_fn, RankedListLoss):
        keys = ("margin", "alpha", "tn", "tp", "lam", "gradient")
        return {k: getattr(loss_fn, k) for k in keys}
    return {"margin": loss_fn.margin, "triplets": loss_fn.triplets}


def test_rll_gradient_reaches_gallery_items_of_every_pair():
    """Weights are constants, but both ends of a pair get gradient (DESIGN.md), unlike the paper's remark."""
    x, y = unequal_batch(seed=16, dtype=torch.float32)
    ref = x.clone().requires_grad_(True)
    q = x[:3].clone().requires_grad_(True)
    RankedListLoss(tn=0.0)(q, y[:3], ref_embeddings=ref, ref_labels=y, query_index=torch.arange(3)).backward()
    assert torch.count_nonzero(ref.grad[3:].abs().sum(1)) > 0
    assert torch.count_nonzero(q.grad.abs().sum(1)) == 3


# --------------------------------------------------------------------------------------------------------
# Tn schedule (RLL Eq. 15)
# --------------------------------------------------------------------------------------------------------


def test_tn_schedule_follows_eq15_and_checkpoints():
    loss_fn = RankedListLoss(tn=99.0)
    schedule = TnSchedule(loss_fn, t1=10.0, t2=2.0, max_iter=4)
    assert loss_fn.tn == 10.0
    seen = [schedule.step() for _ in range(6)]
    assert seen == [8.0, 6.0, 4.0, 2.0, 2.0, 2.0]
    assert schedule.value(1) == 8.0 and loss_fn.tn == 2.0
    restored = TnSchedule(RankedListLoss(), t1=0.0, t2=0.0, max_iter=1)
    schedule.cur_iter = 2
    restored.load_state_dict(schedule.state_dict())
    assert restored.loss.tn == 6.0 and restored.step() == 4.0
    # the loss actually uses the scheduled value
    x, y = unequal_batch(seed=17, dtype=torch.float32)
    values = {tn: RankedListLoss(tn=tn)(x, y).item() for tn in (0.0, 4.0)}
    assert values[0.0] != values[4.0]
    loss_fn.tn = 0.0
    assert loss_fn(x, y).item() == values[0.0]
    with pytest.raises(ValueError, match="max_iter"):
        TnSchedule(loss_fn, 1.0, 2.0, max_iter=0)


# --------------------------------------------------------------------------------------------------------
# bad input: clear errors, never silent NaN
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", ALL_LOSSES, ids=lambda f: type(f).__name__)
def test_bad_input_raises_clear_errors(loss_fn):
    x, y = unequal_batch(seed=18, dtype=torch.float32)
    n = x.shape[0]
    with pytest.raises(ValueError, match="labels has 3 entries but embeddings has"):
        loss_fn(x, y[:3])
    with pytest.raises(ValueError, match="embeddings must be 2-D"):
        loss_fn(x[0], y[:1])
    with pytest.raises(ValueError, match="labels must be an integer tensor"):
        loss_fn(x, y.float())
    with pytest.raises(ValueError, match="labels must be 1-D"):
        loss_fn(x, y[:, None])
    nan = x.clone()
    nan[4, 1] = float("nan")
    with pytest.raises(ValueError, match=r"embeddings contain NaN or Inf in 1 row\(s\) \(first: \[4\]\)"):
        loss_fn(nan, y)
    inf = x.clone()
    inf[2, 0] = float("inf")
    with pytest.raises(ValueError, match="ref_embeddings contain NaN or Inf"):
        loss_fn(x, y, ref_embeddings=inf, ref_labels=y)
    # finite, but their similarities overflow float32 (FastAP's histogram then indexed out of range)
    huge = x.clone()
    huge[3] *= 1e20
    with pytest.raises(
        ValueError, match=r"embeddings have squared norms past torch.float32's range in 1 row"
    ):
        loss_fn(huge, y)
    with pytest.raises(ValueError, match="ref_embeddings have dimension 3"):
        loss_fn(x, y, ref_embeddings=x[:, :3], ref_labels=y)
    with pytest.raises(ValueError, match="without ref_labels"):
        loss_fn(x, y, ref_embeddings=x)
    with pytest.raises(ValueError, match="without ref_embeddings"):
        loss_fn(x, y, query_index=torch.arange(n))
    with pytest.raises(ValueError, match="query_index values must lie in"):
        loss_fn(x, y, ref_embeddings=x, ref_labels=y, query_index=torch.arange(n) + 1)
    with pytest.raises(ValueError, match="whose label"):
        loss_fn(x, y, ref_embeddings=x, ref_labels=y, query_index=torch.arange(n).flip(0))
    with pytest.raises(ValueError, match="reduction must be one of"):
        loss_fn(x, y, reduction="avg")


def test_a_call_under_no_grad_keeps_no_jacobian_for_inputs_that_need_grad():
    """Under torch.no_grad() the row-wise function still saw inputs requiring grad and filled a B x N
    Jacobian nobody could use (at large B, memory a differentiable call would have streamed)."""
    loss = FastAPLoss(saved_budget_mb=1e-9)  # any differentiable call would stream: this one must not
    kernel = loss._kernel
    jacobians: list[bool] = []

    def spy() -> object:
        inner = kernel()

        class Spy:
            metric, needs_positive_sets = inner.metric, inner.needs_positive_sets

            def __call__(self, block):
                jacobians.append(block.jacobian is not None)
                return inner(block)

        return Spy()

    loss._kernel = spy  # type: ignore[method-assign]
    x, y = unequal_batch(seed=18, dtype=torch.float32)
    with torch.no_grad():
        value = loss(x.clone().requires_grad_(), y)
    assert jacobians and not any(jacobians)
    assert value.item() == pytest.approx(FastAPLoss()(x, y).item(), rel=1e-6)


def test_bad_hyper_parameters_are_rejected():
    for make in (
        lambda: FastAPLoss(num_bins=0),
        lambda: FastAPLoss(num_bins=2.5),
        lambda: SmoothAPLoss(temperature=0.0),
        lambda: SmoothAPLoss(temperature=float("nan")),
        lambda: RankedListLoss(lam=1.5),
        lambda: RankedListLoss(tn=float("inf")),
        lambda: TripletLoss(margin=float("nan")),
        lambda: TripletLoss(memory_budget_mb=0),
    ):
        with pytest.raises(ValueError):
            make()
