"""Single-process checks of the chunked global-batch engine against plain whole-batch backpropagation.

The helpers at the top (tiny float64 models, the losses under test, batch builders, the reference
gradient) are shared with tests/test_engine_distributed.py and tests/test_engine_ray.py.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from dmltrain import engine
from dmltrain.engine import chunked_backward, global_batch_step
from dmltrain.losses import FastAPLoss, RankedListLoss, SmoothAPLoss, TripletLoss
from dmltrain.models import ImageNormalizer

# ----------------------------------------------------------------------------------------------------
# shared helpers


class TinyNet(nn.Module):
    """Conv -> BN -> ReLU -> dropout -> conv -> pool -> linear -> L2 norm, small enough for 16 px."""

    def __init__(self, dropout: float = 0.0, dim: int = 8, unused: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.drop = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(6, 8, 3, stride=2, padding=1)
        self.head = nn.Linear(8, dim)
        # A parameter no forward ever touches (DDP find_unused_parameters path).
        self.spare = nn.Linear(2, 2) if unused else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.drop(F.relu(self.bn(self.conv1(x))))
        x = F.relu(self.conv2(x)).mean(dim=(2, 3))
        return F.normalize(self.head(x), dim=1)


def make_model(seed: int = 0, **kwargs) -> TinyNet:
    torch.manual_seed(seed)
    model = TinyNet(**kwargs).double()
    with torch.no_grad():  # non-trivial BN statistics, so frozen vs per-batch statistics differ
        model.bn.running_mean.uniform_(-0.2, 0.2)
        model.bn.running_var.uniform_(0.5, 1.5)
    return model


def preprocess(x: Tensor) -> Tensor:
    return x.to(torch.float64) / 255.0 - 0.5


LOSSES: dict[str, tuple[Callable[[], nn.Module], float]] = {
    # name -> (constructor, relative tolerance of the gradient comparison; the losses work in float64
    # for float64 inputs, so chunking and row-splitting must agree to rounding)
    "fastap": (FastAPLoss, 1e-8),
    "smoothap": (SmoothAPLoss, 1e-8),
    "rll": (RankedListLoss, 1e-8),
    "rll-query": (lambda: RankedListLoss(gradient="query"), 1e-8),  # paper Sec. 3.2: no gradient all-reduce
    "triplet": (TripletLoss, 1e-8),
    "triplet-sampled": (lambda: TripletLoss(triplets="sampled"), 1e-8),
}


def make_batch(size: int, seed: int, side: int = 16) -> tuple[Tensor, Tensor]:
    """uint8 images and labels in random classes (some queries have no positive) that are also laid out as
    the triplet sampler's [q, p, n] triplets (rows 3i, 3i + 1 share a label, row 3i + 2 differs), so every
    loss, the sampled triplet loss included, can score the same batches."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (size, 3, side, side), dtype=torch.uint8, generator=g)
    classes = max(size // 3, 2)
    labels = torch.randint(0, classes, (size,), generator=g)
    labels[1::3] = labels[0::3][: labels[1::3].numel()]
    shift = torch.randint(1, classes, (labels[2::3].numel(),), generator=g)
    labels[2::3] = (labels[0::3][: shift.numel()] + shift) % classes
    return images, labels + 1000  # arbitrary label values


def grads_of(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference_step(
    model: nn.Module,
    loss_fn: nn.Module,
    images: Tensor,
    labels: Tensor,
    chunk_bounds: list[tuple[int, int]] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """What one process computes: loss(model(all inputs), all labels).backward() on a copy of `model`.

    With `chunk_bounds` the forward runs chunk by chunk *with* autograd (per-chunk BatchNorm statistics,
    RNG consumed in the engine's order), the semantics the engine must reproduce in those modes.
    """
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    x = preprocess(images)
    emb = model(x) if chunk_bounds is None else torch.cat([model(x[s:e]) for s, e in chunk_bounds])
    loss = loss_fn(emb, labels)
    loss.backward()
    return loss.detach(), grads_of(model)


def assert_grads_close(got: dict[str, Tensor], want: dict[str, Tensor], rtol: float) -> None:
    assert got.keys() == want.keys()
    assert any(w.abs().max() > 0 for w in want.values()), "reference gradient is zero: nothing is tested"
    for name in want:
        scale = want[name].abs().max().item() + 1e-12
        err = (got[name] - want[name]).abs().max().item()
        assert err <= rtol * scale + 1e-12, f"{name}: max abs error {err:.3e} vs scale {scale:.3e}"


def bounds_of(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk, n)) for s in range(0, n, chunk)]


def frozen_bn(model: nn.Module) -> nn.Module:
    """A copy with BatchNorm in eval mode: the reference for freeze_bn=True."""
    model = copy.deepcopy(model)
    model.bn.eval()
    return model


# ----------------------------------------------------------------------------------------------------
# equivalence


@pytest.mark.parametrize("loss_name", sorted(LOSSES))
@pytest.mark.parametrize("chunk_size", [1, 5, 7, 20, 64])
def test_chunked_gradient_equals_whole_batch_gradient(loss_name: str, chunk_size: int) -> None:
    make_loss, rtol = LOSSES[loss_name]
    loss_fn = make_loss()
    images, labels = make_batch(21, seed=1)
    model = make_model(seed=2)
    want_loss, want = reference_step(frozen_bn(model), loss_fn, images, labels)

    result = global_batch_step(model, images, labels, loss_fn, chunk_size, preprocess=preprocess)

    assert_grads_close(grads_of(model), want, rtol)
    assert math.isclose(result.loss.item(), want_loss.item(), rel_tol=max(rtol, 1e-6))
    assert result.num_chunks == math.ceil(21 / chunk_size)
    assert (result.global_batch_size, result.local_batch_size, result.world_size) == (21, 21, 1)
    assert result.num_queries == 21
    assert result.comm_seconds == 0.0 and result.compute_seconds > 0.0
    assert model.training and model.bn.training, "frozen BatchNorm must be put back in training mode"


def test_num_valid_counts_queries_with_a_positive() -> None:
    images, labels = make_batch(20, seed=1)
    expected = sum(int((labels == v).sum() > 1) for v in labels)
    result = global_batch_step(make_model(), images, labels, SmoothAPLoss(), 6, preprocess=preprocess)
    assert result.num_valid == expected < 20
    assert result.count == float(expected)


def test_dropout_is_replayed_for_every_chunk_size() -> None:
    images, labels = make_batch(18, seed=3)
    loss_fn = SmoothAPLoss()
    for chunk in (1, 4, 7):
        model = make_model(seed=4, dropout=0.3)
        torch.manual_seed(123)
        want_loss, want = reference_step(frozen_bn(model), loss_fn, images, labels, bounds_of(18, chunk))
        after_reference = torch.rand(3)
        torch.manual_seed(123)
        loss = chunked_backward(model, images, labels, loss_fn, chunk, preprocess=preprocess)
        assert_grads_close(grads_of(model), want, 1e-9)
        assert math.isclose(loss.item(), want_loss.item(), rel_tol=1e-6)  # loss reported in float32
        # The RNG stream continues where one forward of the batch would have left it.
        assert torch.equal(torch.rand(3), after_reference)


def test_without_rng_replay_dropout_gradients_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control for the test above: the comparison does detect a missing replay."""
    images, labels = make_batch(18, seed=3)
    loss_fn = SmoothAPLoss()
    model = make_model(seed=4, dropout=0.3)
    torch.manual_seed(123)
    _, want = reference_step(frozen_bn(model), loss_fn, images, labels, bounds_of(18, 4))
    monkeypatch.setattr(engine._RngState, "restore", lambda self, device: None)
    torch.manual_seed(123)
    chunked_backward(model, images, labels, loss_fn, 4, preprocess=preprocess)
    with pytest.raises(AssertionError):
        assert_grads_close(grads_of(model), want, 1e-6)


def test_batchnorm_not_frozen_uses_chunk_statistics_and_updates_running_stats_once() -> None:
    images, labels = make_batch(20, seed=5)
    loss_fn = SmoothAPLoss()
    model = make_model(seed=6)
    reference = copy.deepcopy(model)  # BN in training mode, as the engine runs it with freeze_bn=False
    _, want = reference_step(reference, loss_fn, images, labels, bounds_of(20, 6))
    stats_model = copy.deepcopy(model)
    with torch.no_grad():
        for s, e in bounds_of(20, 6):
            stats_model(preprocess(images[s:e]))

    global_batch_step(model, images, labels, loss_fn, 6, preprocess=preprocess, freeze_bn=False)

    assert_grads_close(grads_of(model), want, 1e-9)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(model.bn, name), getattr(stats_model.bn, name)), name
    assert int(model.bn.num_batches_tracked) == 4


def test_frozen_batchnorm_leaves_running_stats_untouched() -> None:
    model = make_model()
    before = {k: v.clone() for k, v in model.bn.state_dict().items()}
    images, labels = make_batch(12, seed=7)
    chunked_backward(model, images, labels, SmoothAPLoss(), 5, preprocess=preprocess)
    for k, v in model.bn.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_chunks_reach_preprocess_one_at_a_time_as_uint8() -> None:
    seen: list[tuple[tuple[int, ...], torch.dtype]] = []

    def spy(x: Tensor) -> Tensor:
        seen.append((tuple(x.shape), x.dtype))
        return preprocess(x)

    images, labels = make_batch(11, seed=8)
    original = images.clone()
    chunked_backward(make_model(), images, labels, SmoothAPLoss(), 4, preprocess=spy)
    sizes = [s[0][0] for s in seen]
    assert sizes == [4, 4, 3, 4, 4]  # pass 1, then pass 2 re-runs all but the last chunk (its graph was kept)
    assert all(dtype == torch.uint8 for _, dtype in seen)
    assert torch.equal(images, original)


class _CountWaits(TorchDispatchMode):
    """Counts the operators that make a CUDA host wait for the device: a value read back to Python, a
    result whose shape depends on the data, or a tensor built from Python numbers (a copy from pageable
    memory). Visible on a CPU too, where they cost nothing."""

    WAITING = ("aten._local_scalar_dense", "aten.lift_fresh", "aten.nonzero", "aten._unique2")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if str(func.overloadpacket) in self.WAITING:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("loss_name", ["fastap", "smoothap", "rll", "triplet"])
def test_waits_for_the_device_do_not_grow_with_the_number_of_chunks(loss_name: str) -> None:
    """On CUDA each such wait empties the queue of work the host has put ahead of the GPU. Once per chunk
    (the normaliser's mean/std, 64 a step), every pause of the training thread became GPU idle time: an
    H100 sat idle for a quarter of a service step. The loss may wait a few times per step, never per
    chunk (tests/test_gpu.py checks the same on CUDA)."""
    images, labels = make_batch(24, seed=9)
    normalize = ImageNormalizer()
    normalize(images[:1])  # its constants are made on first use on a device, once
    waits = {}
    for chunk in (12, 3):
        with _CountWaits() as counter:
            global_batch_step(
                make_model().float(), images, labels, LOSSES[loss_name][0](), chunk, preprocess=normalize
            )
        waits[chunk] = counter.count
    assert waits[12] > 0, waits  # the counter sees the loss's own reads
    assert waits[3] == waits[12], waits


def test_gradients_accumulate_like_backward() -> None:
    images, labels = make_batch(14, seed=9)
    loss_fn = SmoothAPLoss()
    model = make_model()
    _, want = reference_step(frozen_bn(model), loss_fn, images, labels)
    for _ in range(2):
        chunked_backward(model, images, labels, loss_fn, 4, preprocess=preprocess)
    assert_grads_close(grads_of(model), {k: 2 * v for k, v in want.items()}, 1e-9)


def test_bf16_autocast_runs_the_same_code() -> None:
    images, labels = make_batch(16, seed=10)
    loss_fn = SmoothAPLoss()
    model = make_model().float()

    def to_float(x: Tensor) -> Tensor:
        return x.float() / 255.0 - 0.5

    reference = frozen_bn(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = reference(to_float(images))
    loss_fn(emb.float(), labels).backward()
    want = grads_of(reference)

    result = global_batch_step(
        model, images, labels, loss_fn, 5, preprocess=to_float, autocast_dtype=torch.bfloat16
    )
    assert result.loss.dtype == torch.float32
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    assert_grads_close(grads_of(model), want, 0.05)
    assert engine.default_autocast_dtype(torch.device("cpu")) is None


def test_a_plain_callable_loss_works_in_one_process() -> None:
    from pytorch_metric_learning.losses import MultiSimilarityLoss

    images, labels = make_batch(16, seed=11)
    loss_fn = MultiSimilarityLoss()
    model = make_model()
    want_loss, want = reference_step(frozen_bn(model), loss_fn, images, labels)
    loss = chunked_backward(model, images, labels, loss_fn, 3, preprocess=preprocess)
    assert want_loss.item() > 0
    assert math.isclose(loss.item(), want_loss.item(), rel_tol=1e-6)
    assert_grads_close(grads_of(model), want, 1e-6)


# ----------------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    ("labels", "chunk", "message"),
    [
        (torch.zeros(5, dtype=torch.int64), 4, "labels has 5 entries but inputs has 6"),
        (torch.zeros(6), 4, "integer class ids"),
        (torch.zeros(6, 1, dtype=torch.int64), 4, "1-D"),
        (torch.zeros(6, dtype=torch.int64), 0, "chunk_size"),
    ],
)
def test_bad_arguments_are_named(labels: Tensor, chunk: int, message: str) -> None:
    images, _ = make_batch(6, seed=0)
    with pytest.raises(ValueError, match=message):
        chunked_backward(make_model(), images, labels, SmoothAPLoss(), chunk, preprocess=preprocess)


def test_model_output_must_be_an_embedding_matrix() -> None:
    images, labels = make_batch(6, seed=0)
    model = nn.Sequential(nn.Conv2d(3, 2, 3)).double()
    with pytest.raises(TypeError, match=r"embeddings of shape \(3, D\)"):
        chunked_backward(model, images, labels, SmoothAPLoss(), 3, preprocess=preprocess)


def test_non_finite_embeddings_raise_instead_of_spreading_nan() -> None:
    images, labels = make_batch(6, seed=0)
    model = make_model()
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite embeddings"):
        chunked_backward(model, images, labels, SmoothAPLoss(), 4, preprocess=preprocess)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("chunk", [4, 6])  # two passes, and one pass
def test_skip_nonfinite_returns_nan_and_leaves_gradients_alone(chunk: int) -> None:
    images, labels = make_batch(6, seed=0)
    model = make_model()
    with torch.no_grad():
        model.head.bias.fill_(float("nan"))
    result = global_batch_step(
        model, images, labels, SmoothAPLoss(), chunk, preprocess=preprocess, skip_nonfinite=True
    )
    assert math.isnan(result.loss.item()) and result.num_valid == 0
    assert all(p.grad is None for p in model.parameters())


def test_distributed_helpers_without_a_process_group() -> None:
    from dmltrain import distributed

    assert not distributed.is_distributed()
    assert (distributed.get_rank(), distributed.get_world_size()) == (0, 1)
    x = torch.arange(6.0).reshape(3, 2)
    assert distributed.all_gather_sizes(3) == [3]
    assert distributed.all_gather_uneven(x) is x
    assert torch.equal(distributed.all_reduce_sum_(x.clone()), x)
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    distributed.sum_gradients_([p])
    assert torch.equal(p.grad, torch.full((2,), 3.0))


@pytest.mark.parametrize(("loss_name", "reduces_gradient"), [("rll", True), ("rll-query", False)])
def test_constant_gallery_loss_skips_the_gradient_all_reduce(
    loss_name: str, reduces_gradient: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RLL's paper form moves only the queries: no (B x D) gradient goes through the cross-rank sum."""
    reduced: list[tuple[int, ...]] = []
    real = engine.all_reduce_sum_

    def spy(x: Tensor) -> Tensor:
        reduced.append(tuple(x.shape))
        return real(x)

    monkeypatch.setattr(engine, "all_reduce_sum_", spy)
    images, labels = make_batch(12, seed=4)
    global_batch_step(make_model(), images, labels, LOSSES[loss_name][0](), 5, preprocess=preprocess)
    assert ((12, 8) in reduced) is reduces_gradient
    assert all(len(shape) <= 1 for shape in reduced if shape != (12, 8))


def test_batchnorm_without_running_statistics_is_announced_when_chunked() -> None:
    """freeze_bn=True puts BatchNorm in eval mode, which for a layer without running statistics still
    normalises by the batch: the chunked gradient depended on chunk_size (0.37 relative error at 6 of 18)
    with no word."""
    import warnings

    images, labels = make_batch(18, seed=3)
    model = make_model(seed=4)
    model.bn = nn.BatchNorm2d(6, track_running_stats=False).double()
    with pytest.warns(RuntimeWarning, match=r"cannot freeze BatchNorm without running statistics"):
        global_batch_step(model, images, labels, SmoothAPLoss(), 6, preprocess=preprocess)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one chunk: the batch's own statistics are the global batch's
        global_batch_step(model, images, labels, SmoothAPLoss(), 18, preprocess=preprocess)
