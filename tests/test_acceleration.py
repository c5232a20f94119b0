"""The engine with the network in channels_last, compiled, and under bf16 / fp16 autocast, on CPU.

The chunked step must stay exact whatever the network's memory format or compilation: gradients are
compared with plain whole-batch backpropagation of the eager NCHW network (tests/test_engine.py's
reference machinery). Compilation uses inductor, the backend the service uses (about 30 s to compile the
tiny network here, once per test); the DDP case in test_engine_distributed.py uses aot_eager (see there).
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from test_engine import (
    LOSSES,
    TinyNet,
    assert_grads_close,
    bounds_of,
    frozen_bn,
    grads_of,
    make_batch,
    make_model,
    preprocess,
    reference_step,
)
from torch import Tensor, nn

from dmltrain.acceleration import (
    compile_network,
    compile_state,
    is_convolutional,
    resolve_channels_last,
    resolve_compile,
    resolve_precision,
)
from dmltrain.engine import global_batch_step
from dmltrain.losses import FastAPLoss, SmoothAPLoss

CPU = torch.device("cpu")


def _to_float(x: Tensor) -> Tensor:
    return x.float() / 255.0 - 0.5


def _relative_error(got: dict[str, Tensor], want: dict[str, Tensor]) -> float:
    """Relative L2 error of the whole gradient vector."""
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    ref = torch.cat([want[k].flatten() for k in want])
    return float(diff.norm() / ref.norm())


# ----------------------------------------------------------------------------------------------------
# channels_last


@pytest.mark.parametrize("chunk", [1, 7, 20])
def test_channels_last_gradients_equal_nchw(chunk: int) -> None:
    images, labels = make_batch(20, seed=1)
    loss_fn = SmoothAPLoss()
    model = make_model(seed=2)
    want_loss, want = reference_step(frozen_bn(model), loss_fn, images, labels)
    model = model.to(memory_format=torch.channels_last)
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    seen: list[bool] = []
    model.conv1.register_forward_pre_hook(
        lambda _m, args: seen.append(args[0].is_contiguous(memory_format=torch.channels_last))
    )
    result = global_batch_step(
        model, images, labels, loss_fn, chunk, preprocess=preprocess, channels_last=True
    )
    assert seen and all(seen), "chunks must reach the network in channels_last"
    assert_grads_close(grads_of(model), want, 1e-10)
    assert math.isclose(result.loss.item(), want_loss.item(), rel_tol=1e-6)


# ----------------------------------------------------------------------------------------------------
# torch.compile (inductor)


def test_compiled_channels_last_gradients_equal_eager_for_every_loss() -> None:
    """One compiled network, chunked with a remainder and in one pass, against eager NCHW backprop."""
    images, labels = make_batch(21, seed=3)  # whole triplets, for the sampled triplet loss
    model = make_model(seed=4)
    compiled = compile_network(copy.deepcopy(model).to(memory_format=torch.channels_last))
    assert compile_state(compiled) == "untried"
    for name, (make_loss, _) in sorted(LOSSES.items()):
        for chunk in (8, 21):
            loss_fn = make_loss()
            want_loss, want = reference_step(frozen_bn(model), loss_fn, images, labels)
            compiled.zero_grad(set_to_none=True)
            result = global_batch_step(
                compiled, images, labels, loss_fn, chunk, preprocess=preprocess, channels_last=True
            )
            # float64 throughout: inductor's generated kernels differ from eager by reordered sums only
            assert_grads_close(grads_of(compiled), want, 1e-9)
            assert math.isclose(result.loss.item(), want_loss.item(), rel_tol=1e-6), (name, chunk)
    assert compile_state(compiled) == "works"


def test_compiled_dropout_is_replayed_exactly() -> None:
    """Pass 1 (no grad) and the replay (with grad) run different compiled graphs; their dropout masks must
    still agree, so the chunked gradient equals a per-chunk forward with autograd of the same network."""
    images, labels = make_batch(18, seed=5)
    loss_fn = SmoothAPLoss()
    model = compile_network(make_model(seed=6, dropout=0.3))
    reference = compile_network(frozen_bn(make_model(seed=6, dropout=0.3)))

    def reference_grads(seed: int) -> dict[str, Tensor]:
        reference.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        x = preprocess(images)
        emb = torch.cat([reference(x[s:e]) for s, e in bounds_of(18, 7)])
        loss_fn(emb, labels).backward()
        return grads_of(reference)

    want = reference_grads(123)
    after_reference = torch.rand(3)
    torch.manual_seed(123)
    global_batch_step(model, images, labels, loss_fn, 7, preprocess=preprocess)
    assert torch.equal(torch.rand(3), after_reference)  # the stream continues as after one forward
    assert_grads_close(grads_of(model), want, 1e-9)
    with pytest.raises(AssertionError):  # control: other masks give another gradient
        assert_grads_close(grads_of(model), reference_grads(124), 1e-6)


# ----------------------------------------------------------------------------------------------------
# compile fallback and bookkeeping (a failing backend stands in for a platform without a compiler)


def _failing_backend(gm, example_inputs):
    raise RuntimeError("no compiler on this platform")


def _steps_with_backend(backend, batch: int, seed: int, chunk: int, steps: int = 1) -> list[str]:
    """``steps`` engine steps of a model compiled with ``backend``: it must have fallen back to eager with
    the eager gradient; the warnings' messages."""
    images, labels = make_batch(batch, seed=seed)
    loss_fn = SmoothAPLoss()
    model = make_model(seed=seed + 1)
    _, want = reference_step(frozen_bn(model), loss_fn, images, labels)
    compile_network(model, backend=backend)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            global_batch_step(model, images, labels, loss_fn, chunk, preprocess=preprocess)
    assert compile_state(model) == "eager"
    assert_grads_close(grads_of(model), want, 1e-10)
    return [str(w.message) for w in caught]


def test_compile_failure_falls_back_to_eager_with_one_warning() -> None:
    messages = _steps_with_backend(_failing_backend, 12, seed=7, chunk=5, steps=2)
    compile_warnings = [m for m in messages if "torch.compile failed" in m]
    assert len(compile_warnings) == 1, messages
    assert "no compiler on this platform" in compile_warnings[0]


def _bad_backward_backend(gm, example_inputs):
    """Compiles forward graphs, fails on every backward: AOTAutograd compiled backwards lazily, at the
    engine's first backward, outside the compiled forward's fallback."""
    from torch._dynamo.backends.common import aot_autograd

    def forward(graph, _inputs):
        return graph.forward

    def backward(_graph, _inputs):
        raise RuntimeError("no kernel for this backward")

    return aot_autograd(fw_compiler=forward, bw_compiler=backward)(gm, example_inputs)


@pytest.mark.parametrize("chunk", [7, 64])
def test_a_backward_that_does_not_compile_falls_back_to_eager(chunk: int) -> None:
    messages = _steps_with_backend(_bad_backward_backend, 18, seed=5, chunk=chunk)
    assert any("no kernel for this backward" in m for m in messages)


def test_a_fallback_within_a_step_runs_the_step_again_eagerly() -> None:
    """Pass 1 ran inductor's no-grad graph (its dropout masks); the grad-mode graph then failed and pass 2
    replayed the chunks eagerly, with eager's masks: a gradient of no single forward (relative error 1.2)."""
    from torch._inductor.compile_fx import compile_fx

    def no_grad_only(gm, example_inputs):
        if torch.is_grad_enabled():
            raise RuntimeError("this backward does not compile")
        return compile_fx(gm, example_inputs)

    images, labels = make_batch(18, seed=5)
    loss_fn = SmoothAPLoss()
    reference = frozen_bn(make_model(seed=6, dropout=0.3))
    model = compile_network(copy.deepcopy(reference), backend=no_grad_only)
    torch.manual_seed(123)
    x = preprocess(images)
    loss_fn(torch.cat([reference(x[s:e]) for s, e in bounds_of(18, 7)]), labels).backward()
    after_reference = torch.rand(3)
    torch.manual_seed(123)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        global_batch_step(model, images, labels, loss_fn, 7, preprocess=preprocess)
    assert compile_state(model) == "eager"
    assert torch.equal(torch.rand(3), after_reference)  # one step's draws, not two
    assert _relative_error(grads_of(model), grads_of(reference)) < 1e-10


def test_errors_of_the_call_itself_propagate_and_keep_compilation() -> None:
    model = compile_network(make_model(seed=9), backend="aot_eager")
    with pytest.raises(RuntimeError):
        model(torch.zeros(2, 5, 16, 16, dtype=torch.float64))  # 5 channels: the model's fault, not compile's
    assert compile_state(model) == "untried"
    model(torch.zeros(2, 3, 16, 16, dtype=torch.float64))
    assert compile_state(model) == "works"
    assert compile_network(model) is model and compile_state(model) == "works"  # compiling twice: no-op


def test_deep_copy_of_a_compiled_network_runs_its_own_weights() -> None:
    model = compile_network(make_model(seed=10), backend="aot_eager")
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    before = model(x)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.head.weight.mul_(-1.0)
    assert not torch.allclose(twin(x), before)
    assert torch.equal(model(x), before)
    assert set(twin.state_dict()) == set(TinyNet().state_dict())  # no wrapper prefix in the keys


# ----------------------------------------------------------------------------------------------------
# precision


def test_bf16_chunked_matches_unchunked_bf16_within_tolerance() -> None:
    """Same network, same bf16 autocast; only the chunking differs. bf16 keeps 8 mantissa bits (relative
    rounding 2^-9), and each chunk's weight gradient is rounded before the float32 sum over chunks, so
    2e-2 relative L2 error bounds the difference (7e-3 measured here); fp32 chunking agrees to 1e-5."""
    images, labels = make_batch(32, seed=11)
    loss_fn = FastAPLoss()
    base = make_model(seed=12).float()
    reference = frozen_bn(base)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = reference(_to_float(images))
    loss_fn(emb.float(), labels).backward()
    want = grads_of(reference)
    model = copy.deepcopy(base)
    global_batch_step(model, images, labels, loss_fn, 8, preprocess=_to_float, autocast_dtype=torch.bfloat16)
    assert _relative_error(grads_of(model), want) <= 2e-2
    fp32 = copy.deepcopy(base)
    global_batch_step(fp32, images, labels, loss_fn, 8, preprocess=_to_float)
    fp32_ref = frozen_bn(base)
    loss_fn(fp32_ref(_to_float(images)), labels).backward()
    assert _relative_error(grads_of(fp32), grads_of(fp32_ref)) <= 1e-5


def test_fp16_with_a_grad_scaler_gives_the_scaled_chunked_gradient() -> None:
    """fp16 autocast (CPU supports it too): `.grad` holds scale x the gradient of the unchunked fp16 step;
    after unscale_ it matches within fp16 rounding (10 mantissa bits: 1e-2 relative L2 is generous)."""
    images, labels = make_batch(32, seed=13)
    loss_fn = SmoothAPLoss(temperature=0.05)
    base = make_model(seed=14).float()
    reference = frozen_bn(base)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with torch.autocast("cpu", dtype=torch.float16):
        emb = reference(_to_float(images))
    ref_scaler.scale(loss_fn(emb.float(), labels)).backward()
    scaled_want = grads_of(reference)

    model = copy.deepcopy(base)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    result = global_batch_step(
        model,
        images,
        labels,
        loss_fn,
        8,
        preprocess=_to_float,
        autocast_dtype=torch.float16,
        grad_scaler=scaler,
    )
    assert math.isfinite(result.loss.item())
    assert _relative_error(grads_of(model), scaled_want) <= 1e-2  # both scaled by 1024
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    unscaled = grads_of(model)
    assert _relative_error(unscaled, {k: v / 1024.0 for k, v in scaled_want.items()}) <= 1e-2
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_fp16_overflow_is_left_to_the_scaler() -> None:
    """A huge scale overflows the fp16 backward: the engine still returns the loss; the scaler skips."""
    images, labels = make_batch(16, seed=15)
    model = make_model(seed=16).float()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    result = global_batch_step(
        model,
        images,
        labels,
        SmoothAPLoss(),
        8,
        preprocess=_to_float,
        autocast_dtype=torch.float16,
        grad_scaler=scaler,
    )
    assert math.isfinite(result.loss.item())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert scaler.get_scale() < 2.0**60


# ----------------------------------------------------------------------------------------------------
# what `auto` resolves to


def test_auto_settings_on_cpu_keep_todays_behaviour() -> None:
    import torchvision

    assert resolve_precision("auto", CPU).autocast_dtype is None
    assert resolve_precision("bf16", CPU).autocast_dtype == torch.bfloat16
    fp16 = resolve_precision("fp16", CPU)
    assert fp16.autocast_dtype == torch.float16 and fp16.grad_scaling
    assert not resolve_precision("bf16", CPU).grad_scaling
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("fp8", CPU)  # type: ignore[arg-type]
    resnet = torchvision.models.resnet18()
    patchy = nn.Sequential(nn.Conv2d(3, 8, 16, stride=16), nn.Flatten(), nn.Linear(8, 4))  # ViT-like stem
    assert is_convolutional(resnet) and not is_convolutional(patchy)
    assert not resolve_channels_last("auto", CPU, resnet)
    assert resolve_channels_last(True, CPU, patchy) and not resolve_channels_last(False, CPU, resnet)
    assert not resolve_compile("auto", CPU) and resolve_compile(True, CPU)
    cuda = torch.device("cuda")
    assert resolve_channels_last("auto", cuda, resnet) and not resolve_channels_last("auto", cuda, patchy)
    assert resolve_compile("auto", cuda)
