"""Column streaming (the loss keeps per-row statistics instead of the rows x columns Jacobian) and the
device-aware memory budgets.

Streaming is forced on CPU with a tiny ``saved_budget_mb``; a tiny ``memory_budget_mb`` then also splits the
queries into many row groups and the references into many column tiles (and a big class's positives into
several slabs). Values and gradients must equal the unstreamed path to float rounding (float64) and to
float32 accuracy, on in-batch retrieval and on the engine's explicit-gallery path; gradcheck covers the
streamed backward on its own.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_losses import CASES, GRADCHECK_CASES, _hyper, case_id, make_loss, ref_mean, unequal_batch

from dmltrain.losses import FastAPLoss, RankedListLoss, SmoothAPLoss, TripletLoss
from dmltrain.losses._budget import DEFAULT_MEMORY_BUDGET_MB, host_available_bytes, memory_budgets
from dmltrain.losses._streamed import tiling

STREAM = {"saved_budget_mb": 1e-6}  # any Jacobian is larger: always stream
TINY = {"saved_budget_mb": 1e-6, "memory_budget_mb": 0.004}  # ~87 elements per block: many groups and tiles


def _batch(seed: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """A big class (12), triples, pairs and singletons, shuffled: ragged positive counts in every group."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.cat(
        [torch.full((12,), 5), torch.arange(10, 20).repeat_interleave(3), torch.tensor([30, 30, 31, 32])]
    )
    labels = labels[torch.randperm(labels.numel(), generator=g)]
    x = F.normalize(torch.randn(labels.numel(), 10, generator=g, dtype=torch.float64), dim=1)
    return x.to(dtype), labels


def _backward_node_names(value: torch.Tensor) -> set[str]:
    names, todo = set(), [value.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or type(node).__name__ in names:
            continue
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


def _value_and_grads(loss_fn, queries, q_labels, refs=None, r_labels=None, query_index=None):
    q = queries.detach().clone().requires_grad_(True)
    kwargs = {}
    r = None
    if refs is not None:
        r = refs.detach().clone().requires_grad_(True)
        kwargs = {"ref_embeddings": r, "ref_labels": r_labels, "query_index": query_index}
    value = loss_fn(q, q_labels, **kwargs)
    value.backward()
    return value.detach(), q.grad, None if r is None else r.grad, _backward_node_names(value)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("budget", [STREAM, TINY], ids=["one-tile", "many-tiles"])
def test_streamed_equals_unstreamed_in_float64(case, budget):
    kind, params = case
    x, y = _batch(seed=1)
    want, want_grad, _, want_nodes = _value_and_grads(make_loss(kind, params), x, y)
    got, got_grad, _, got_nodes = _value_and_grads(make_loss(kind, params, **budget), x, y)
    assert "_StreamedFunctionBackward" in got_nodes and "_StreamedFunctionBackward" not in want_nodes
    assert "_RowwiseFunctionBackward" in want_nodes and "_RowwiseFunctionBackward" not in got_nodes
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-14)
    assert want_grad.abs().max() > 0
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_streamed_explicit_gallery_matches_reference_and_unstreamed(case):
    """The engine's call: local queries against a gathered gallery holding them (query_index)."""
    kind, params = case
    gallery, g_labels = _batch(seed=2)
    qidx = torch.tensor([3, 0, 17, 9, 25, 40])
    queries, q_labels = gallery[qidx], g_labels[qidx]
    want = _value_and_grads(make_loss(kind, params), queries, q_labels, gallery, g_labels, qidx)
    got = _value_and_grads(make_loss(kind, params, **TINY), queries, q_labels, gallery, g_labels, qidx)
    assert "_StreamedFunctionBackward" in got[3]
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got[2], want[2], rtol=1e-9, atol=1e-12)
    # and the plain-loop reference written from the papers' equations
    q2 = queries.clone().requires_grad_(True)
    r2 = gallery.clone().requires_grad_(True)
    expected = ref_mean(kind, params, q2, q_labels, r2, g_labels, qidx.tolist())
    expected.backward()
    assert got[0].item() == pytest.approx(expected.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(got[1], q2.grad, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(got[2], r2.grad, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("kind", ["fastap", "smoothap", "rll", "triplet"])
def test_streamed_gallery_without_the_queries(kind):
    params = dict(CASES)[kind] if kind != "smoothap" else {"tau": 0.05}
    gallery, g_labels = _batch(seed=3)
    queries, q_labels = unequal_batch(seed=4, dim=10)
    q_labels = torch.tensor([5, 10, 11, 30, 5, 12, 31, 99, 13, 5, 14, 15, 16, 17, 18, 19])[: len(q_labels)]
    want = _value_and_grads(make_loss(kind, params), queries, q_labels, gallery, g_labels)
    got = _value_and_grads(make_loss(kind, params, **TINY), queries, q_labels, gallery, g_labels)
    assert got[0].item() == pytest.approx(want[0].item(), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got[2], want[2], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_streamed_float32_matches_unstreamed(case):
    kind, params = case
    x, y = _batch(seed=5, dtype=torch.float32)
    want, want_grad, _, _ = _value_and_grads(make_loss(kind, params), x, y)
    got, got_grad, _, _ = _value_and_grads(make_loss(kind, params, **TINY), x, y)
    assert got.item() == pytest.approx(want.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("budget", [STREAM, TINY], ids=["one-tile", "many-tiles"])
def test_streamed_fastap_with_a_duplicate_positive_matches_unstreamed(budget):
    """A positive equal to its query sits on a bin centre (t = 0): its value from the row group's own
    product could round to the other side of it than its tile's, and the streamed gradient was off by
    several times its size (22 of 100 seeds in float64, 31 in float32)."""
    worst = 0.0
    for seed in range(40):
        generator = torch.Generator().manual_seed(seed)
        for dtype in (torch.float64, torch.float32):
            x = torch.nn.functional.normalize(
                torch.randn(32, 16, generator=generator, dtype=torch.float64), dim=1
            )
            x = x.to(dtype)
            y = torch.randint(0, 8, (32,), generator=generator)
            x[1], y[1] = x[0], y[0]
            _, want, _, _ = _value_and_grads(FastAPLoss(), x, y)
            _, got, _, _ = _value_and_grads(FastAPLoss(**budget), x, y)
            worst = max(worst, ((got - want).norm() / want.norm()).item())
    assert worst < 1e-4


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=case_id)
def test_streamed_gradcheck_float64(case):
    kind, params = case
    x, y = unequal_batch(seed=6, dim=4)
    loss_fn = make_loss(kind, params, **TINY)
    q = x[:5].clone().requires_grad_(True)
    ref = x.clone().requires_grad_(True)
    qi = torch.arange(5)
    assert torch.autograd.gradcheck(lambda e: loss_fn(e, y), (ref,), eps=1e-6, atol=1e-6)
    assert torch.autograd.gradcheck(
        lambda a, b: loss_fn(a, y[:5], ref_embeddings=b, ref_labels=y, query_index=qi, reduction="sum"),
        (q, ref),
        eps=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize(
    "loss_fn",
    [FastAPLoss(**TINY), SmoothAPLoss(0.05, **TINY), RankedListLoss(**TINY), TripletLoss(**TINY)],
    ids=lambda f: type(f).__name__,
)
def test_streamed_parts_counts_and_determinism(loss_fn):
    x, y = _batch(seed=7, dtype=torch.float32)
    plain = type(loss_fn)(**_hyper(loss_fn))
    got = loss_fn.parts(x.clone().requires_grad_(True), y)
    want = plain.parts(x.clone().requires_grad_(True), y)
    assert (got.num_queries, got.num_valid) == (want.num_queries, want.num_valid)
    torch.testing.assert_close(got.count, want.count)
    torch.testing.assert_close(got.total.detach(), want.total.detach(), rtol=1e-5, atol=1e-6)
    first = _value_and_grads(loss_fn, x, y)
    again = _value_and_grads(loss_fn, x, y)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_no_grad_calls_never_stream():
    """Without a backward nothing is kept, so the (faster) row-block path runs whatever the budget."""
    x, y = _batch(seed=8, dtype=torch.float32)
    loss_fn = SmoothAPLoss(**STREAM)
    with torch.no_grad():
        value = loss_fn(x, y)
    assert value.grad_fn is None
    assert value.item() == pytest.approx(SmoothAPLoss()(x, y).item(), rel=1e-6)
    assert loss_fn.streams(len(x), len(x), x.device, x.dtype)
    assert not SmoothAPLoss().streams(len(x), len(x), x.device, x.dtype)


def test_cpu_budgets_are_unchanged_and_explicit_values_win():
    block, saved = memory_budgets(torch.device("cpu"), None, None)
    assert block == int(DEFAULT_MEMORY_BUDGET_MB * 2**20) == 64 * 2**20
    # streaming on CPU only where the saved Jacobian could not be held at all
    assert abs(saved - host_available_bytes()) < 2**30
    assert memory_budgets(torch.device("cpu"), 3.0, 5.0) == (3 * 2**20, 5 * 2**20)
    assert memory_budgets(torch.device("cpu"), None, float("inf"))[1] >= 2**62  # never stream
    big = FastAPLoss()
    assert not big.streams(8192, 8192, torch.device("cpu"), torch.float32)  # 256 MiB Jacobian: kept
    assert big.streams(10**6, 10**6, torch.device("cpu"), torch.float32)  # 4 TB: streamed


def test_tiling_stays_within_the_budget_and_covers_everything():
    for n_q, n_ref, budget in [(1, 1, 1), (7, 1000, 48 * 50), (1000, 7, 48 * 50), (5000, 9000, 64 << 20)]:
        rows, cols = tiling(n_q, n_ref, budget)
        assert 1 <= rows <= n_q and 1 <= cols <= n_ref
        assert rows * cols <= max(1, budget // 48)
    # a budget that holds the whole matrix needs no column tiles
    assert tiling(100, 200, 48 * 100 * 200) == (100, 200)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "64", True])
def test_bad_budgets_are_rejected(value):
    with pytest.raises(ValueError, match="saved_budget_mb must be positive"):
        FastAPLoss(saved_budget_mb=value)
    with pytest.raises(ValueError, match="memory_budget_mb must be positive"):
        TripletLoss(memory_budget_mb=value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_budgets_come_from_the_device_and_streaming_matches():
    device = torch.device("cuda")
    block, saved = memory_budgets(device, None, None)
    assert 64 * 2**20 <= block <= 2048 * 2**20
    assert saved > block  # a modern GPU keeps a B=8192 Jacobian (256 MiB)
    x, y = _batch(seed=9, dtype=torch.float32)
    x, y = x.to(device), y.to(device)
    for kind, params in CASES:
        want = _value_and_grads(make_loss(kind, params), x, y)
        got = _value_and_grads(make_loss(kind, params, **TINY), x, y)
        assert "_StreamedFunctionBackward" in got[3], kind
        assert got[0].item() == pytest.approx(want[0].item(), rel=1e-5, abs=1e-7), kind
        torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
