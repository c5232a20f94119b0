"""Convolutions with tiny outputs as matrix products when training on CPU.

Why: a ResNet's last stages see 1x1 or 2x2 feature maps at small inputs (ResNet-18 at 32 px, the
quickstart), and oneDNN, which computes PyTorch's CPU convolutions, is slow on them: for weight gradients
it takes its GEMM-based kernel (``x64:gemm:jit`` in ONEDNN_VERBOSE). Measured on a 2-core AVX2 CPU (AMD
EPYC, 2 threads, batch 128; `python bench/small_convs.py`, 2026-11-26): a training call of a 512->512 3x3
convolution on a 1x1 map 135 ms -> 6.9 ms; ResNet-18's whole training step at 32 px 0.666 -> 0.333 s.

Two rewrites, each the same sum in another order (the results differ by float rounding only):
- a 1x1 input with a 1x1 output meets one kernel tap (the rest multiply padding): the convolution is a
  linear layer on that tap, forward and backward (train mode only, so evaluation and serving compute
  exactly what a plain model does);
- otherwise, for outputs of 1x1 (any kernel) or 2x2 (kernels larger than 1x1), the forward pass and the
  input gradient stay oneDNN's and the weight gradient is unfold(x)ᵀ·grad in one matrix product. Only
  where oneDNN would take its GEMM kernel for that gradient: on CPUs whose best instruction set is AVX2.
  With AVX-512 oneDNN has direct kernels (``jit:avx512_core`` in ONEDNN_VERBOSE) and the matrix product
  is slower: on a 2-core AVX-512 EPYC (`python bench/small_convs.py`, 2026-11-26), 10.9 ms against 8.3 for
  a 256->256 3x3 training call on a 2x2 map, and ResNet-18's 32 px step ran 1.18x PyTorch's speed with
  the tap alone against 1.13x with both rewrites.
Larger outputs, where oneDNN is as fast or faster, keep PyTorch's path; so does everything off the CPU,
under autocast, grouped or non-zero-padded.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "SmallOutputConv2d",
    "gemm_weight_grads_help",
    "small_conv_path",
    "use_matmul_for_small_convs",
    "weight_grad_by_gemm",
]

_Pair = tuple[int, int]
ConvPath = Literal["tap", "gemm_weight_grad", "native"]


def weight_grad_by_gemm(
    x: Tensor, grad: Tensor, weight: Tensor, stride: _Pair, padding: _Pair, dilation: _Pair
) -> Tensor:
    """d(loss)/d(weight) of conv2d(x, weight) (groups=1) given d(loss)/d(output): one matmul of the
    gradient rows against the unfolded input, over every image and output pixel at once."""
    columns = F.unfold(x, weight.shape[-2:], dilation, padding, stride)  # (N, C*kh*kw, pixels)
    n, _, pixels = columns.shape
    out_channels = grad.shape[1]
    rows = grad.reshape(n, out_channels, pixels).transpose(0, 1).reshape(out_channels, n * pixels)
    return (rows @ columns.transpose(1, 2).reshape(n * pixels, -1)).view_as(weight)


class _ConvWithGemmWeightGrad(torch.autograd.Function):
    """conv2d (groups=1, no bias) whose backward computes the weight gradient as one GEMM."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, stride: _Pair, padding: _Pair, dilation: _Pair) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.geometry = (stride, padding, dilation)
        return F.conv2d(x, weight, None, stride, padding, dilation)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        stride, padding, dilation = ctx.geometry
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten.convolution_backward(
                grad, x, weight, None, stride, padding, dilation, False, (0, 0), 1, (True, False, False)
            )[0]
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad_by_gemm(x, grad, weight, stride, padding, dilation)
        return grad_x, grad_w, None, None, None


def _output_size(conv: nn.Conv2d, x: Tensor) -> tuple[int, int]:
    geometry = zip(x.shape[-2:], conv.kernel_size, conv.stride, conv.padding, conv.dilation, strict=True)
    h, w = ((size + 2 * p - d * (k - 1) - 1) // s + 1 for size, k, s, p, d in geometry)  # type: ignore[operator]
    return h, w


# Read once: a plain global lets torch.compile fold it (calling into torch.backends here broke the graph
# at every convolution).
_AVX2_AT_BEST = torch.backends.cpu.get_cpu_capability() == "AVX2"


def gemm_weight_grads_help() -> bool:
    """Whether this CPU's oneDNN computes small weight gradients with its slow GEMM kernel (AVX2 at best).

    Measured on AVX2 and AVX-512 CPUs only; other instruction sets keep PyTorch's path for them.
    """
    return _AVX2_AT_BEST


def small_conv_path(conv: nn.Conv2d, x: Tensor) -> ConvPath:
    """Which computation `SmallOutputConv2d` uses for this call (see the module docstring)."""
    if x.device.type != "cpu" or x.dim() != 4 or torch.is_autocast_enabled("cpu"):
        return "native"
    if conv.groups != 1 or conv.padding_mode != "zeros" or isinstance(conv.padding, str):
        return "native"
    weight_grad = torch.is_grad_enabled() and conv.weight.requires_grad
    if not (conv.training or weight_grad):  # evaluation and serving: neither rewrite applies
        return "native"
    out = _output_size(conv, x)
    one_pixel = tuple(x.shape[-2:]) == (1, 1) == out and conv.dilation == (1, 1)
    padding, kernel = conv.padding, conv.kernel_size
    if conv.training and one_pixel and all(p < k for p, k in zip(padding, kernel, strict=True)):  # type: ignore[operator]
        return "tap"
    if not weight_grad:
        return "native"
    by_gemm = getattr(conv, "gemm_weight_grads", None)
    if not (gemm_weight_grads_help() if by_gemm is None else by_gemm):
        return "native"
    pixels = out[0] * out[1]
    if pixels == 1 or (pixels <= 4 and conv.kernel_size != (1, 1)):
        return "gemm_weight_grad"
    return "native"


class SmallOutputConv2d(nn.Conv2d):
    """An `nn.Conv2d` that computes tiny outputs as matrix products where `small_conv_path` says so.

    Same parameters, buffers and state_dict keys as the Conv2d it replaces. ``gemm_weight_grads``:
    ``None`` decides by the CPU (`gemm_weight_grads_help`), ``True``/``False`` force the second rewrite.
    """

    gemm_weight_grads: bool | None = None

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        path = small_conv_path(self, input)
        if path == "tap":
            tap = weight[:, :, self.padding[0], self.padding[1]]  # type: ignore[index]
            return F.linear(input.flatten(1), tap, bias)[:, :, None, None]
        if path == "gemm_weight_grad":
            out = _ConvWithGemmWeightGrad.apply(input, weight, self.stride, self.padding, self.dilation)
            return out if bias is None else out + bias.view(1, -1, 1, 1)
        return super()._conv_forward(input, weight, bias)


def use_matmul_for_small_convs(model: nn.Module, gemm_weight_grads: bool | None = None) -> int:
    """Turn every plain `nn.Conv2d` in ``model`` into a `SmallOutputConv2d`, in place; returns how many.

    ``gemm_weight_grads`` sets `SmallOutputConv2d.gemm_weight_grads` on each (``None``: by the CPU).
    Subclasses (timm's same-padding convs and the like) keep their own forward and are left alone.
    """
    converted = 0
    for module in model.modules():
        if type(module) is nn.Conv2d:
            module.__class__ = SmallOutputConv2d
            converted += 1
        if isinstance(module, SmallOutputConv2d) and gemm_weight_grads is not None:
            module.gemm_weight_grads = gemm_weight_grads
    return converted
