"""Benchmark: convolutions with tiny outputs on CPU, PyTorch's own (oneDNN) against dmltrain.small_convs.

    python bench/small_convs.py            # batch 128, 2 threads, 7 rounds
    python bench/small_convs.py --quick    # batch 32, 3 rounds (smoke)

Part 1, one convolution at a time, a training call (forward, then backward to the weight and the input):
`nn.Conv2d` against the same module after `use_matmul_for_small_convs(gemm_weight_grads=True)` (the path
`small_conv_path` then picks: tap = a linear layer on the one kernel tap a 1x1 input meets,
gemm_weight_grad = oneDNN's forward and input gradient with the weight gradient as one matmul, native =
unchanged), for ResNet shapes from a 1x1 to a 7x7 output; the median of the rounds, the ratio, the largest
weight-gradient difference relative to the gradient's largest entry, and the path this CPU takes by default
(the weight-gradient matmul only where the CPU's best instruction set is AVX2).

Part 2, a whole training step: ResNet-18 (embedding 128) at 32 px, the quickstart's network and batch,
frozen BatchNorm, forward, a loss, backward and fused Adam; PyTorch's convolutions against the same network
after `use_matmul_for_small_convs` with both rewrites and with the tap alone (the default marked), in
interleaved rounds in one process so load changes hit all alike.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dmltrain.models import build_model, freeze_batchnorm
from dmltrain.small_convs import gemm_weight_grads_help, small_conv_path, use_matmul_for_small_convs

# (channels in = out, input side, kernel, stride): ResNet-18/50 stages at small inputs
SHAPES = [(512, 1, 3, 1), (512, 1, 1, 1), (2048, 1, 1, 1), (256, 2, 3, 2), (256, 2, 3, 1), (512, 2, 3, 1)]
SHAPES += [(256, 2, 1, 1), (128, 4, 3, 1), (512, 4, 3, 1), (64, 8, 3, 1), (256, 7, 3, 1), (512, 7, 1, 1)]


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _training_call(conv: nn.Conv2d, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    conv.weight.grad = None
    x.grad = None
    conv(x).backward(grad)
    return conv.weight.grad


def part1(batch: int, rounds: int) -> None:
    print(f"\nPart 1: one convolution's training call, batch {batch}, median of {rounds} rounds")
    header = f"{'conv':<22}{'in':>5}{'out':>5}{'PyTorch ms':>12}{'dmltrain ms':>13}{'speed-up':>10}"
    print(f"{header}{'rel. diff':>11}  {'path':<17}default here")
    for channels, side, kernel, stride in SHAPES:
        torch.manual_seed(0)
        native = nn.Conv2d(channels, channels, kernel, stride, kernel // 2, bias=False)
        rewritten, default = copy.deepcopy(native), copy.deepcopy(native)
        use_matmul_for_small_convs(rewritten, gemm_weight_grads=True)
        use_matmul_for_small_convs(default)
        x = torch.randn(batch, channels, side, side, requires_grad=True)
        grad = torch.randn_like(native(x))
        want, got = _training_call(native, x, grad), _training_call(rewritten, x, grad)
        diff = ((want - got).abs().max() / want.abs().max()).item()
        before = _median_ms(lambda: _training_call(native, x, grad), rounds)  # noqa: B023
        after = _median_ms(lambda: _training_call(rewritten, x, grad), rounds)  # noqa: B023
        name = f"{channels}->{channels} {kernel}x{kernel} /{stride}"
        sides = f"{side}x{side}", f"{grad.shape[-1]}x{grad.shape[-1]}"
        cells = f"{before:>12.1f}{after:>13.1f}{before / after:>9.2f}x{diff:>11.1e}"
        paths = f"{small_conv_path(rewritten, x):<17}{small_conv_path(default, x)}"
        print(f"{name:<22}{sides[0]:>5}{sides[1]:>5}{cells}  {paths}")


def _train_step(gemm_weight_grads: bool | None, batch: int) -> Callable[[], None]:
    """One training step's closure; ``gemm_weight_grads`` None = PyTorch's convolutions."""
    torch.manual_seed(0)
    model = build_model("resnet18", 128)
    model.train()
    freeze_batchnorm(model)
    if gemm_weight_grads is not None:
        use_matmul_for_small_convs(model, gemm_weight_grads)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    images = torch.randn(batch, 3, 32, 32)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(images).square().sum().backward()
        optimizer.step()

    return step


def part2(batch: int, rounds: int, steps: int) -> float:
    print(f"\nPart 2: ResNet-18 training step at 32 px, batch {batch}, {rounds} interleaved rounds", end="")
    print(f" of {steps} steps")
    default = gemm_weight_grads_help()
    variants: dict[str, bool | None] = {"PyTorch's convolutions (oneDNN)": None}
    for gemm in (True, False):
        mark = " [default here]" if gemm == default else ""
        variants[("tap + weight-grad matmul" if gemm else "tap alone") + mark] = gemm
    built = {name: _train_step(gemm, batch) for name, gemm in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for name in variants:  # warm-up
        built[name]()
    for r in range(rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        for name in order:
            start = time.perf_counter()
            for _ in range(steps):
                built[name]()
            times[name].append((time.perf_counter() - start) / steps)
    base = statistics.median(times["PyTorch's convolutions (oneDNN)"])
    for name in variants:
        median = statistics.median(times[name])
        print(f"  {name:<42}{median:>7.3f} s/step  {batch / median:>6.0f} img/s  {base / median:>5.2f}x")
    chosen = next(name for name, gemm in variants.items() if gemm == default)
    return base / statistics.median(times[chosen])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, rounds, steps = (32, 3, 2) if args.quick else (128, 7, 4)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability ", end="")
    print(torch.backends.cpu.get_cpu_capability())
    part1(batch, rounds)
    speedup = part2(batch, rounds, steps)
    print(f"\nResNet-18 32 px training step: {speedup:.2f}x with this CPU's default small-convolution paths")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
