"""Benchmark: what the device decode path's crop loop costs a training thread beside it, through the GIL.

    python bench/decode_thread.py            # 5 interleaved rounds of 3 s per case
    python bench/decode_thread.py --quick    # 2 rounds of 1 s (smoke)

With data.decode=gpu a thread of the training process crops and resamples every image of the next batch
(`TrainAugment.resample_batch`) while the training thread launches the step. Both need the GIL, so the
loop's Python costs the step time even where the GPU has room. This runs, in one process on this machine's
device (CUDA if present), a training-like thread (a small network's forward, backward and Adam step: many
short torch calls, as a GPU training thread makes) alone, and beside a thread that runs `resample_batch`
flat out, with its per-image loop in Python (``off_the_gil=False``) and compiled by TorchScript (the
default, `dmltrain.data.crops`). Rounds interleave the cases so load changes hit all alike. It prints the
training steps/s and crops/s of each case, and the training rate as a ratio of the rate alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dmltrain.data import train_transform


def _training_step(device: torch.device):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(12):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU()]
    model = nn.Sequential(*layers).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        optimizer.step()

    return step


def _images(device: torch.device, count: int, side: int) -> tuple[list[torch.Tensor], list]:
    generator = torch.Generator().manual_seed(0)
    augment = train_transform(side // 2)
    images, params = [], []
    for _ in range(count):
        rows, cols = (int(v) for v in torch.randint(side // 2, side + 1, (2,), generator=generator))
        images.append(
            torch.randint(0, 256, (3, rows, cols), dtype=torch.uint8, generator=generator).to(device)
        )
        params.append(augment.draw(rows, cols))
    return images, params, augment


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_case(step, crop, device: torch.device, seconds: float) -> tuple[float, float]:
    """Training steps/s, and crop batches/s of a thread beside it (0 without one)."""
    stop = threading.Event()
    batches = [0]

    def crop_forever() -> None:
        while not stop.is_set():
            crop()
            _sync(device)
            batches[0] += 1

    thread = threading.Thread(target=crop_forever, daemon=True) if crop else None
    if thread:
        thread.start()
        time.sleep(0.2)
    steps, start, done = 0, time.perf_counter(), batches[0]
    while time.perf_counter() - start < seconds:
        step()
        _sync(device)
        steps += 1
    elapsed = time.perf_counter() - start
    crops = batches[0] - done
    stop.set()
    if thread:
        thread.join()
    return steps / elapsed, crops / elapsed


def interleaved(cases: dict, step, warm_ups: int, rounds: int, run_case) -> dict[str, list]:
    """`run_case(beside)` for every case in turn, `rounds` times (load changes hit all cases alike), after
    `warm_ups` training steps and calls of each case's thread work."""
    for beside in cases.values():
        for _ in range(warm_ups):
            step()
            if beside:
                beside()
    results: dict[str, list] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, beside in cases.items():
            results[name].append(run_case(beside))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 s")
    parser.add_argument("--images", type=int, default=256, help="images per crop call")
    parser.add_argument("--side", type=int, default=96, help="largest decoded image side (crops are side/2)")
    args = parser.parse_args()
    rounds, seconds = (2, 1.0) if args.quick else (5, 3.0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core each for the two threads, as a GPU process's host threads
    step = _training_step(device)
    images, params, augment = _images(device, args.images, args.side)
    cases = {
        "training alone": None,
        "beside crops in Python": lambda: augment.resample_batch(images, params, off_the_gil=False),
        "beside crops in TorchScript": lambda: augment.resample_batch(images, params),
    }
    # the warm-up steps include TorchScript's profiling runs
    results = interleaved(cases, step, 3, rounds, lambda crop: _run_case(step, crop, device, seconds))
    print(
        f"device {device}, torch {torch.__version__}, {args.images} images a crop call, {rounds} rounds of "
        f"{seconds:.0f} s (median)"
    )
    alone = statistics.median(r[0] for r in results["training alone"])
    print(f"{'case':<30}{'train steps/s':>15}{'vs alone':>10}{'crops/s':>10}")
    for name, rows in results.items():
        rate = statistics.median(r[0] for r in rows)
        crops = statistics.median(r[1] for r in rows) * args.images
        print(f"{name:<30}{rate:>15.1f}{rate / alone:>9.2f}x{crops:>10.0f}")


if __name__ == "__main__":
    main()
