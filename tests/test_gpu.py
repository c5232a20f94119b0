"""CUDA checks of the engine at GPU speed and of the service on a GPU worker (`pytest -m gpu`).

Skipped with a reason where CUDA is absent (CI and the CPU development machines). Tolerances are stated per
test: TF32 is switched off wherever fp32 results are compared, so differences come from reordered float32
sums (cuDNN algorithms differ between NCHW and channels_last, inductor fuses differently), or from bf16 /
fp16 rounding where autocast is on.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import warnings
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


def has_faiss() -> bool:
    """The retrieval plots need faiss; a GPU machine may have the gpu extra's build or none."""
    return importlib.util.find_spec("faiss") is not None


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


def _chunked_step(base, images, labels, loss_fn, chunk: int, dtype, scaler=None) -> tuple[dict, object]:
    """A copy of `base` after one `global_batch_step` in chunks of `chunk`: (its gradients, the result)."""
    model = copy.deepcopy(base)
    result = global_batch_step(
        model,
        images,
        labels,
        loss_fn,
        chunk,
        preprocess=normalize_images,
        autocast_dtype=dtype,
        grad_scaler=scaler,
    )
    return grads_of(model), result


def _cosine(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    a = torch.cat([got[k].flatten() for k in want])
    b = torch.cat([want[k].flatten() for k in want])
    return float(a @ b / (a.norm() * b.norm()))


def _relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    return float(diff.norm() / torch.cat([want[k].flatten() for k in want]).norm())


def test_bf16_chunked_step_matches_fp32_within_tolerance(no_tf32: None) -> None:
    """bf16 keeps 8 mantissa bits, and the gradient of a ranking loss through a random-init ResNet-18 (all
    embeddings nearly alike) amplifies rounding: the unchunked bf16 gradient is 0.38-0.43 relative L2 from
    fp32 (cosine 0.91-0.93, H100). cuDNN picks other kernels for a chunk of 16 than for 64 images, so the
    chunked bf16 step rounds differently again (0.10-0.12 from the unchunked bf16 one). What the chunking
    must not do is add error of its own: with one chunk it is the unchunked bf16 step (0.0 measured), and
    with four it is no farther from fp32 than the unchunked bf16 step (within 10%; measured +0.1% to +1.5%).
    Also: loss within 1e-2, embeddings within 5e-2 relative L2 of fp32."""
    images, labels = _images(64)
    x = normalize_images(images.to(CUDA))
    for loss_fn in (FastAPLoss(), SmoothAPLoss(temperature=0.05)):
        base = _resnet()
        fp32 = _unchunked(base, images, labels, loss_fn)
        bf16 = _unchunked(base, images, labels, loss_fn, torch.bfloat16)
        grads = {}
        for chunk in (64, 16):
            grads[chunk], result = _chunked_step(base, images, labels, loss_fn, chunk, torch.bfloat16)
        with torch.no_grad():
            e32 = base(x)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                e16 = base(x).float()
            l32 = float(loss_fn(e32, labels.to(CUDA)))
        assert abs(result.loss.item() - l32) <= 1e-2 * abs(l32)
        assert float((e16 - e32).norm() / e32.norm()) <= 5e-2
        assert _relative_error(grads[64], bf16) <= 1e-3  # one chunk: the unchunked bf16 step
        rounding = _relative_error(bf16, fp32)
        assert _relative_error(grads[16], fp32) <= 1.1 * rounding, rounding
        assert _cosine(grads[16], fp32) >= _cosine(bf16, fp32) - 0.01
        assert _relative_error(grads[16], bf16) <= 0.5 * rounding  # chunking: less than bf16's own error


def test_compiled_channels_last_gradients_match_eager_nchw(no_tf32: None) -> None:
    """fp32, TF32 off, against the eager NCHW whole-batch gradient: eager NCHW in chunks within 1e-4 relative
    L2 (4.8e-6 measured on an H100: the chunking is exact); compiled + channels_last in chunks within 1e-2
    and cosine >= 0.9999 (3.7e-3 measured, of which eager channels_last alone gives 1.8e-3: cuDNN's NHWC
    kernels sum in another order, and the ranking loss amplifies it on nearly alike embeddings)."""
    images, labels = _images(48)
    loss_fn = SmoothAPLoss(temperature=0.05)
    base = _resnet(seed=2)
    want = _unchunked(base, images, labels, loss_fn)
    eager = copy.deepcopy(base)
    global_batch_step(eager, images, labels, loss_fn, 16, preprocess=normalize_images)
    assert _relative_error(grads_of(eager), want) <= 1e-4
    fast = compile_network(copy.deepcopy(base).to(memory_format=torch.channels_last))
    for chunk in (16, 20):  # a remainder chunk too
        fast.zero_grad(set_to_none=True)
        global_batch_step(
            fast, images, labels, loss_fn, chunk, preprocess=normalize_images, channels_last=True
        )
        assert _relative_error(grads_of(fast), want) <= 1e-2, chunk
        assert _cosine(grads_of(fast), want) >= 0.9999, chunk
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
    """As for bf16: one chunk is the unchunked fp16 step (0.0 measured on an H100); in chunks of 16 the
    gradient is no farther from fp32 than the unchunked fp16 one (0.14 vs 0.15 relative L2 measured; cosine
    0.99), with the loss scaled by the GradScaler and unscaled by the optimizer step as in the service."""
    images, labels = _images(48, seed=3)
    loss_fn = FastAPLoss()
    base = _resnet(seed=4)
    want = _unchunked(base, images, labels, loss_fn, torch.float16, scale=1024.0)
    fp32 = _unchunked(base, images, labels, loss_fn, None, scale=1024.0)
    grads = {}
    for chunk in (48, 16):
        scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
        grads[chunk], _ = _chunked_step(base, images, labels, loss_fn, chunk, torch.float16, scaler)
    assert _relative_error(grads[48], want) <= 1e-3
    rounding = _relative_error(want, fp32)
    assert _relative_error(grads[16], fp32) <= 1.1 * rounding, rounding
    assert _cosine(grads[16], fp32) >= 0.98


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


def test_a_step_waits_for_the_gpu_no_more_often_with_more_chunks() -> None:
    """The host must queue a step's chunks ahead of the GPU. Every operation that waits for the device
    (`.item()`, a copy from pageable memory) drains that queue; once per chunk (the normaliser's mean/std
    copies, 64 a step of 16 chunks) it left an H100 idle for a quarter of a service step whenever the
    training thread paused (torch.profiler trace, 2026-11-26). The loss waits a few times per step; the
    count must not grow with the number of chunks."""
    images, labels = _images(64, seed=7)
    images = images.pin_memory()
    loss_fn = SmoothAPLoss(temperature=0.05)
    model = _resnet(seed=8)
    waits = {}
    for chunk in (32, 8):  # 2 and 8 chunks
        step = functools.partial(
            global_batch_step, model, images, labels, loss_fn, chunk, preprocess=normalize_images
        )
        step()  # warm-up: kernels chosen, the normaliser's constants made
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        waits[chunk] = sum("synchronizing CUDA operation" in str(w.message) for w in caught)
    assert waits[32] > 0, waits  # the detector sees the loss's own waits
    assert waits[8] == waits[32], waits


def test_auto_precision_on_this_gpu() -> None:
    precision = resolve_precision("auto", CUDA)
    major, _ = torch.cuda.get_device_capability()
    assert precision.name == ("bf16" if major >= 8 else "fp16")
    assert precision.grad_scaling == (precision.name == "fp16")


def test_step_seeds_reach_the_gpu_generator_and_leave_the_host_one_alone() -> None:
    """A network on the GPU draws dropout masks from the GPU's generator; the host's may be in use by a
    prefetch thread drawing crops under its own seed (in-process loader), so a step must not reseed it."""
    from dmltrain.service.train import seed_step_randomness

    def masks(rank: int, step: int) -> torch.Tensor:
        seed_step_randomness(0, rank, step, CUDA)
        return torch.rand(16, device=CUDA).cpu()

    host = torch.get_rng_state()
    assert torch.equal(masks(0, 3), masks(0, 3)) and not torch.equal(masks(0, 3), masks(1, 3))
    assert torch.equal(torch.get_rng_state(), host)


def test_a_step_too_large_for_the_gpu_is_one_line_naming_the_chunk() -> None:
    """A real CUDA out-of-memory error: the worker loop's line keeps torch's account and names the key."""
    from dmltrain.service.config import load_config
    from dmltrain.service.train import device_memory_error

    config = load_config(REPO / "configs" / "quickstart.yaml")
    with pytest.raises(torch.cuda.OutOfMemoryError) as caught:
        torch.empty(2**50, dtype=torch.uint8, device=CUDA)
    line = str(device_memory_error(caught.value, config, evaluating=False))
    print(line)
    assert line.startswith("CUDA out of memory. Tried to allocate") and "total capacity of" in line
    assert line.endswith(
        "lower train.chunk_size (now 128; a step's memory grows with the chunk, not with the batch)"
    )


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
            f"eval.grid_queries={2 if has_faiss() else 0}",
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
