"""Data pipeline throughput: stream + decode + augment + class-balanced batching vs. the same decode + augment
on in-memory bytes (the ceiling) vs. torchvision ImageFolder + DataLoader, all in one process run.

    python bench/data.py [--quick] [--workers 2]

Ratios are against the raw decode+augment rate measured in the same run (the machine may be shared).
Goal: streamed P x K batches at >= 0.9x the raw rate.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import datasets
from torchvision.transforms import v2

from dmltrain.data import SamplerSpec, TrainLoader, decode, prepare, train_transform


def make_images(root: Path, classes: int, per_class: int, size: tuple[int, int]) -> list[Path]:
    """Smooth colour fields plus noise saved as JPEG: decode cost close to photos of that size."""
    rng = np.random.default_rng(0)
    paths = []
    h, w = size
    yy, xx = np.mgrid[0:h, 0:w]
    for c in range(classes):
        for i in range(per_class):
            a, b, d = rng.uniform(0.01, 0.1, 3)
            base = np.stack([np.sin(a * xx + i), np.cos(b * yy + c), np.sin(d * (xx + yy))], axis=-1)
            pixels = np.clip(127 + 90 * base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
            path = root / f"class{c:03d}" / f"{i:03d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(path, quality=90)
            paths.append(path)
    return paths


def rate(make: Callable[[], Iterator[int]], batches: int, repeats: int) -> float:
    """Steady-state images/s: one warm-up batch (process start, buffer fill) is not timed."""
    best = 0.0
    for _ in range(repeats):
        iterator = make()
        next(iterator)
        start = time.perf_counter()
        n = sum(next(iterator) for _ in range(batches))
        best = max(best, n / (time.perf_counter() - start))
        del iterator
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, one repeat (about 30 s)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers for the parallel rows")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--crop", type=int, default=224)
    args = parser.parse_args()
    torch.set_num_threads(1)
    classes, per_class, size = (32, 16, (256, 320)) if args.quick else (96, 16, (256, 320))
    repeats = 1 if args.quick else 2
    transform = train_transform(args.crop, scale=(0.16, 1.0))
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        paths = make_images(tmp_path / "src", classes, per_class, size)
        prepare("folder", str(tmp_path / "src"), tmp_path / "shards", shard_size=64, progress=False)
        blobs = [p.read_bytes() for p in paths]
        batches = max(4, len(blobs) // args.batch)
        spec = SamplerSpec(name="pk", samples_per_class=4, pool_images=4 * args.batch)

        def raw() -> Iterator[int]:
            for start in itertools.count(0, args.batch):
                chunk = [blobs[(start + i) % len(blobs)] for i in range(args.batch)]
                yield len(torch.stack([transform(decode(b)) for b in chunk]))

        def streamed(workers: int) -> Callable[[], Iterator[int]]:
            def go() -> Iterator[int]:
                loader = TrainLoader(
                    tmp_path / "shards",
                    args.batch,
                    spec,
                    rank=0,
                    world_size=1,
                    num_workers=workers,
                    transform=transform,
                )
                while True:
                    yield len(loader.next_batch()[1])

            return go

        def image_folder(workers: int) -> Callable[[], Iterator[int]]:
            pil_transform = v2.Compose([v2.PILToTensor(), transform])
            dataset = datasets.ImageFolder(str(tmp_path / "src"), transform=pil_transform)

            def go() -> Iterator[int]:
                while True:
                    loader = DataLoader(
                        dataset,
                        batch_size=args.batch,
                        shuffle=True,
                        num_workers=workers,
                        drop_last=True,
                        persistent_workers=workers > 0,
                    )
                    for _, labels in loader:
                        yield len(labels)

            return go

        rows = [("raw decode + augment (in-memory bytes, 1 process)", raw)]
        rows += [("dmltrain stream + P x K batches (0 workers)", streamed(0))]
        rows += [("torchvision ImageFolder + DataLoader (0 workers)", image_folder(0))]
        rows += [(f"dmltrain stream + P x K batches ({args.workers} workers)", streamed(args.workers))]
        rows += [
            (f"torchvision ImageFolder + DataLoader ({args.workers} workers)", image_folder(args.workers))
        ]
        results = [(name, rate(fn, batches, repeats)) for name, fn in rows]
    baseline = results[0][1]
    print(
        f"{len(blobs)} JPEG {size[1]}x{size[0]} -> {args.crop}px crops, batch {args.batch}, torch threads 1"
    )
    print("| pipeline | images/s | vs raw |\n|---|---|---|")
    for name, value in results:
        print(f"| {name} | {value:.0f} | {value / baseline:.2f}x |")


if __name__ == "__main__":
    main()
