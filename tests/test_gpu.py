"""CUDA checks of the engine at GPU speed and of the service on a GPU worker (`pytest -m gpu`).

Skipped with a reason where CUDA is absent (CI and the CPU development machines). Tolerances are stated per
test: TF32 is switched off wherever fp32 results are compared, so differences come from reordered float32
sums (cuDNN algorithms differ between NCHW and channels_last, inductor fuses differently), or from bf16 /
fp16 rounding where autocast is on.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_engine import bounds_of, grads_of, make_batch, make_model

from dmltrain.acceleration import compile_network, compile_state, resolve_precision
from dmltrain.engine import global_batch_step
from dmltrain.losses import FastAPLoss, SmoothAPLoss
from dmltrain.models import build_model, freeze_batchnorm, normalize_images

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA: run `pytest -m gpu` on a GPU machine"
    ),
]

REPO = Path(__file__).parents[1]
CUDA = torch.device("cuda")


@pytest.fixture
def no_tf32() -> Iterator[None]:
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _resnet(seed: int = 0) -> torch.nn.Module:
    """ResNet-18 whose frozen BatchNorm statistics come from data (as a pretrained network's would)."""
    torch.manual_seed(seed)
    model = build_model("resnet18", 128).to(CUDA)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.reset_running_stats()
            m.momentum = None  # cumulative average over the calibration batch
    model.train()
    with torch.no_grad():
        model(normalize_images(_images(128, seed=seed + 100)[0].to(CUDA)))
    freeze_batchnorm(model)
    return model


def _images(batch: int, side: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=g)
    labels = torch.arange(batch) // 4
    return images, labels[torch.randperm(batch, generator=g)]


def _unchunked(model, images, labels, loss_fn, dtype=None, scale: float = 1.0) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
        emb = model(normalize_images(images.to(CUDA)))
    (loss_fn(emb.float(), labels.to(CUDA)) * scale).backward()
    return grads_of(model)


def _cosine(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    a = torch.cat([got[k].flatten() for k in want])
    b = torch.cat([want[k].flatten() for k in want])
    return float(a @ b / (a.norm() * b.norm()))


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    return float(diff.norm() / torch.cat([want[k].flatten() for k in want]).norm())


def test_bf16_chunked_step_matches_fp32_within_tolerance(no_tf32: None) -> None:
    """bf16 keeps 8 mantissa bits: through a random-init ResNet-18 the embeddings move by about 3% and the
    loss by 1e-4, and the gradient of a ranking loss, made of small similarity differences, turns by up to
    25 degrees (cosine 0.90-0.94 measured with CPU autocast). Stated bounds: loss within 1e-2, embeddings
    within 5e-2 relative L2, gradient cosine >= 0.8 against fp32; and the chunking adds nothing beyond
    rounding: within 1e-2 relative L2 of the unchunked bf16 step (2.3e-3 measured with CPU autocast)."""
    images, labels = _images(64)
    x = normalize_images(images.to(CUDA))
    for loss_fn in (FastAPLoss(), SmoothAPLoss(temperature=0.05)):
        base = _resnet()
        fp32 = _unchunked(base, images, labels, loss_fn)
        bf16 = _unchunked(base, images, labels, loss_fn, torch.bfloat16)
        model = copy.deepcopy(base)
        result = global_batch_step(
            model, images, labels, loss_fn, 16, preprocess=normalize_images, autocast_dtype=torch.bfloat16
        )
        with torch.no_grad():
            e32 = base(x)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                e16 = base(x).float()
            l32 = float(loss_fn(e32, labels.to(CUDA)))
        got = grads_of(model)
        assert abs(result.loss.item() - l32) <= 1e-2 * abs(l32)
        assert float((e16 - e32).norm() / e32.norm()) <= 5e-2
        assert _cosine(got, fp32) >= 0.8
        assert _relative_error(got, bf16) <= 1e-2


def test_compiled_channels_last_gradients_match_eager_nchw(no_tf32: None) -> None:
    """fp32, TF32 off: compiled + channels_last chunked vs eager NCHW whole batch within 1e-3 relative L2."""
    images, labels = _images(48)
    loss_fn = SmoothAPLoss(temperature=0.05)
    base = _resnet(seed=2)
    want = _unchunked(base, images, labels, loss_fn)
    fast = compile_network(copy.deepcopy(base).to(memory_format=torch.channels_last))
    for chunk in (16, 20):  # a remainder chunk too
        fast.zero_grad(set_to_none=True)
        global_batch_step(
            fast, images, labels, loss_fn, chunk, preprocess=normalize_images, channels_last=True
        )
        assert _relative_error(grads_of(fast), want) <= 1e-3, chunk
    assert compile_state(fast) == "works"


def test_compiled_dropout_is_replayed_on_cuda() -> None:
    """Inductor's own RNG on CUDA: the no-grad pass-1 graph and the replayed graph draw the same masks."""
    images, labels = make_batch(18, seed=5)
    loss_fn = SmoothAPLoss()

    def prep(x: torch.Tensor) -> torch.Tensor:
        return x.float() / 255.0 - 0.5

    model = compile_network(make_model(seed=6, dropout=0.3).float().to(CUDA))
    reference = compile_network(copy.deepcopy(model))
    reference.bn.eval()

    def reference_grads(seed: int) -> dict[str, torch.Tensor]:
        reference.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        x = prep(images.to(CUDA))
        emb = torch.cat([reference(x[s:e]) for s, e in bounds_of(18, 7)])
        loss_fn(emb, labels.to(CUDA)).backward()
        return grads_of(reference)

    want = reference_grads(123)
    torch.manual_seed(123)
    global_batch_step(model, images, labels, loss_fn, 7, preprocess=prep)
    assert _relative_error(grads_of(model), want) <= 1e-5
    assert _relative_error(grads_of(model), reference_grads(124)) > 1e-3  # control: other masks


def test_fp16_with_grad_scaler_matches_unchunked_fp16() -> None:
    images, labels = _images(48, seed=3)
    loss_fn = FastAPLoss()
    base = _resnet(seed=4)
    want = _unchunked(base, images, labels, loss_fn, torch.float16, scale=1024.0)
    model = copy.deepcopy(base)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    global_batch_step(
        model,
        images,
        labels,
        loss_fn,
        16,
        preprocess=normalize_images,
        autocast_dtype=torch.float16,
        grad_scaler=scaler,
    )
    assert _relative_error(grads_of(model), want) <= 2e-2


def test_chunked_step_memory_is_flat_in_batch_size() -> None:
    """Peak CUDA memory of a chunked step grows with the chunk, not the batch: B=512 within 1.25x of B=64."""
    peaks = {}
    for batch in (64, 512):
        model = _resnet(seed=5)
        images, labels = _images(batch, seed=6)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        global_batch_step(model, images, labels, FastAPLoss(), 32, preprocess=normalize_images)
        torch.cuda.synchronize()
        peaks[batch] = torch.cuda.max_memory_allocated() - base
        del model
        torch.cuda.empty_cache()
    assert peaks[512] <= 1.25 * peaks[64], peaks


def test_auto_precision_on_this_gpu() -> None:
    precision = resolve_precision("auto", CUDA)
    major, _ = torch.cuda.get_device_capability()
    assert precision.name == ("bf16" if major >= 8 else "fp16")
    assert precision.grad_scaling == (precision.name == "fp16")


@pytest.mark.service
def test_service_runs_two_steps_on_a_gpu_worker(ray_cluster, glyphs_root: Path, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    from dmltrain.service.config import load_config
    from dmltrain.service.run import launch

    if ray_cluster.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the local Ray cluster sees no GPU")
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"data.root={glyphs_root}",
            "data.prepare=null",
            "run.name=gpu-two-steps",
            f"run.storage_path={tmp_path / 'ray_results'}",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "scaling.num_workers=1",
            "scaling.use_gpu=true",
            "train.steps=2",
            "train.log_every=1",
            "train.global_batch_size=64",
            "train.chunk_size=16",
            "train.eval_at_start=false",
            "eval.max_images=400",
            "eval.grid_queries=2",
        ],
    )
    outcome = launch(config)
    client = MlflowClient(outcome.tracking_uri)
    run = client.get_run(outcome.mlflow_run_id)
    assert run.info.status == "FINISHED"
    tags = run.data.tags
    assert tags["dmltrain.device"].startswith("cuda"), tags["dmltrain.device"]
    assert tags["dmltrain.precision"] == resolve_precision("auto", CUDA).name
    assert tags["dmltrain.channels_last"] == "true" and tags["dmltrain.compile"] == "works"
    losses = client.get_metric_history(outcome.mlflow_run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2] and all(math.isfinite(m.value) for m in losses)
    assert any(k.startswith("eval/") for k in outcome.metrics), outcome.metrics
