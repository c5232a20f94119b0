"""Small convolutions as matrix products on CPU: PyTorch's own outputs and gradients, up to float rounding."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from dmltrain.acceleration import resolve_small_conv_matmul
from dmltrain.models import build_model, freeze_batchnorm
from dmltrain.small_convs import SmallOutputConv2d, small_conv_path, use_matmul_for_small_convs


def _grads(conv: nn.Conv2d, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    conv.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(x.requires_grad)
    out = conv(x)
    out.backward(grad_out)
    found = [out.detach(), conv.weight.grad]
    if conv.bias is not None:
        found.append(conv.bias.grad)
    if x.requires_grad:
        found.append(x.grad)
    return tuple(found)


# (in, out, kernel, stride, padding, dilation, bias, input side, the path taken): 1x1 and 2x2 outputs
GEOMETRIES = [
    (16, 24, 3, 1, 1, 1, False, 1, "tap"),  # ResNet's last block at 32 px: a 3x3 conv on a 1x1 map
    (16, 24, 3, 1, 1, 1, True, 1, "tap"),
    (16, 24, 1, 1, 0, 1, True, 1, "tap"),
    (16, 24, 3, 1, 1, 1, True, 2, "gemm_weight_grad"),
    (16, 24, 3, 2, 1, 1, False, 4, "gemm_weight_grad"),  # strided, into a 2x2 output
    (16, 24, 1, 2, 0, 1, False, 2, "gemm_weight_grad"),  # the 1x1 downsample into a 1x1 output
    (8, 12, 3, 1, 2, 2, True, 2, "gemm_weight_grad"),  # dilated
    (8, 12, 3, 1, 2, 2, False, 1, "gemm_weight_grad"),  # dilated on one pixel: not the tap
    (8, 12, (3, 1), (1, 1), (1, 0), 1, False, 2, "gemm_weight_grad"),  # non-square kernel
    (8, 12, 3, 2, 1, 1, False, 1, "tap"),  # strided on one pixel
]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "-".join(map(str, g)))
@pytest.mark.parametrize("input_grad", [True, False])
def test_outputs_and_gradients_equal_pytorchs_on_each_path(geometry, input_grad: bool) -> None:
    cin, cout, kernel, stride, padding, dilation, bias, side, path = geometry
    torch.manual_seed(0)
    native = nn.Conv2d(cin, cout, kernel, stride, padding, dilation, bias=bias).double()
    gemm = copy.deepcopy(native)
    assert use_matmul_for_small_convs(gemm, gemm_weight_grads=True) == 1 and isinstance(
        gemm, SmallOutputConv2d
    )
    x = torch.randn(5, cin, side, side, dtype=torch.float64, requires_grad=input_grad)
    assert small_conv_path(gemm, x) == path  # the path under test is the one that runs
    grad_out = torch.randn_like(native(x))
    for want, got in zip(_grads(native, x, grad_out), _grads(gemm, x, grad_out), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_channels_last_input_gives_the_same_gradients() -> None:
    torch.manual_seed(1)
    native = nn.Conv2d(8, 8, 3, padding=1, bias=False).to(memory_format=torch.channels_last)
    gemm = copy.deepcopy(native)
    use_matmul_for_small_convs(gemm, gemm_weight_grads=True)
    x = torch.randn(6, 8, 2, 2).contiguous(memory_format=torch.channels_last).requires_grad_()
    grad_out = torch.randn(6, 8, 2, 2).contiguous(memory_format=torch.channels_last)
    assert small_conv_path(gemm, x) == "gemm_weight_grad"
    for want, got in zip(_grads(native, x, grad_out), _grads(gemm, x, grad_out), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_matrix_products_only_for_cpu_training_calls_with_tiny_outputs() -> None:
    conv3 = SmallOutputConv2d(4, 4, 3, padding=1)
    conv1 = SmallOutputConv2d(4, 4, 1)
    conv3.gemm_weight_grads = conv1.gemm_weight_grads = True  # as on an AVX2 CPU
    one, two, three = torch.randn(2, 4, 1, 1), torch.randn(2, 4, 2, 2), torch.randn(2, 4, 3, 3)
    assert small_conv_path(conv3, one) == "tap" and small_conv_path(conv1, one) == "tap"
    assert small_conv_path(conv3, two) == "gemm_weight_grad"
    assert small_conv_path(conv3, three) == "native"  # a 3x3 output: oneDNN is as fast
    assert small_conv_path(conv1, two) == "native"  # 1x1 kernels on 2x2 maps too
    with torch.no_grad():  # the engine's first pass in train mode: the same forward as with gradients
        assert small_conv_path(conv3, one) == "tap" and small_conv_path(conv3, two) == "native"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert small_conv_path(conv3, one) == small_conv_path(conv3, two) == "native"
    assert small_conv_path(SmallOutputConv2d(4, 4, 3, padding=1, groups=2), one) == "native"
    assert small_conv_path(SmallOutputConv2d(4, 4, 3, padding=1, padding_mode="reflect"), one) == "native"
    conv3.eval()  # evaluation and serving: PyTorch's own forward pass (only a weight gradient may change)
    assert small_conv_path(conv3, one) == "gemm_weight_grad"
    with torch.no_grad():
        assert small_conv_path(conv3, one) == "native"
    conv3.train()
    conv3.weight.requires_grad_(False)
    assert small_conv_path(conv3, one) == "tap" and small_conv_path(conv3, two) == "native"


def test_without_weight_gradient_matmuls_only_the_tap_is_rewritten() -> None:
    """With AVX-512, oneDNN's own weight-gradient kernels beat the matrix product (module docstring)."""
    for geometry in GEOMETRIES:
        cin, cout, kernel, stride, padding, dilation, bias, side, path = geometry
        conv = SmallOutputConv2d(cin, cout, kernel, stride, padding, dilation, bias=bias)
        conv.gemm_weight_grads = False
        x = torch.randn(2, cin, side, side)
        assert small_conv_path(conv, x) == ("tap" if path == "tap" else "native"), geometry


@pytest.mark.parametrize(("capability", "path"), [("avx2", "gemm_weight_grad"), ("default", "native")])
def test_weight_gradient_matmuls_by_default_only_on_avx2_cpus(capability: str, path: str) -> None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"an x86 CPU with AVX2 (this one: {torch.backends.cpu.get_cpu_capability()})")
    code = (
        "import torch; from dmltrain.small_convs import SmallOutputConv2d, small_conv_path; "
        "print(small_conv_path(SmallOutputConv2d(4, 4, 3, padding=1), torch.randn(2, 4, 2, 2)))"
    )
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}  # what torch dispatches to, read at start-up
    found = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert found.stdout.strip() == path


def _resnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = build_model("resnet18", 16)
    model.train()
    freeze_batchnorm(model)
    return model


@pytest.mark.parametrize("gemm_weight_grads", [True, False], ids=["avx2-paths", "avx512-paths"])
def test_resnet18_at_32px_trains_with_the_same_gradients_and_keeps_its_state_dict(gemm_weight_grads) -> None:
    native, gemm = _resnet(), _resnet()
    converted = use_matmul_for_small_convs(gemm, gemm_weight_grads)
    assert converted == sum(type(m) is nn.Conv2d for m in native.modules()) == 20
    assert list(gemm.state_dict()) == list(native.state_dict())
    images = torch.randn(8, 3, 32, 32)
    for model in (native, gemm):
        out = model(images)
        out.square().sum().backward()
    gemm_out = out.detach()
    for (name, want), got in zip(native.named_parameters(), gemm.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():
        # the engine's first (no-grad) pass computes exactly what its gradient pass will
        assert torch.equal(gemm(images), gemm_out)
        native.eval(), gemm.eval()  # evaluation and serving: PyTorch's own convolutions, bit for bit
        assert torch.equal(gemm(images), native(images))


def test_a_converted_model_copies_and_saves_like_any_module() -> None:
    model = _resnet()
    use_matmul_for_small_convs(model)
    copied = copy.deepcopy(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = model(images)  # train mode: the rewritten paths
        assert torch.equal(copied(images), want) and torch.equal(loaded(images), want)
    assert use_matmul_for_small_convs(model) == 0  # converting twice changes nothing


def test_subclassed_convolutions_are_left_alone() -> None:
    class SamePadding(nn.Conv2d):
        pass

    model = nn.Sequential(SamePadding(3, 3, 3), nn.Conv2d(3, 3, 3))
    assert use_matmul_for_small_convs(model) == 1
    assert type(model[0]) is SamePadding and type(model[1]) is SmallOutputConv2d


def test_auto_means_cpu() -> None:
    assert resolve_small_conv_matmul("auto", torch.device("cpu"))
    assert not resolve_small_conv_matmul("auto", torch.device("cuda"))
    assert not resolve_small_conv_matmul(False, torch.device("cpu"))
    assert resolve_small_conv_matmul(True, torch.device("cuda"))


def test_the_choice_of_path_does_not_break_a_compiled_graph() -> None:
    """train.compile on CPU: deciding the path must not stop torch.compile at every convolution."""
    model = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1, stride=2))
    use_matmul_for_small_convs(model)  # the CPU decides the weight-gradient path
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(torch.randn(2, 4, 2, 2))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
