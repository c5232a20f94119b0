"""The loader's CPU per training batch at the quickstart's scale, against the per-image path it replaced.

    python bench/loader_cpu.py [--data DIR] [--batches 100] [--rounds 5]

On 2 cores the loader process takes turns with the training step's threads (bench/service.py, part 1:
"service step + live data"), so its CPU per batch is what the service pays for data. One process, 0 loader
workers, 1 torch thread (as in a DataLoader worker), the quickstart's TrainLoader on the bundled glyphs
(64 px grey PNGs, 32 px crops, global batch 128); four variants in interleaved rounds, each timing
`next_batch` (tar reading, P x K sampling, decode, augment, the batch tensor):
  cached           as the service runs it: the shard cache (`data.cache_mb`) after its first pass (no tar
                   read, no PNG decode), each block's crop draws, crops and resizes in one compiled loop
                   (`TrainAugment.augment_many`, since 2026-11-27), and the batch tensor
  cached, one by one  the same, image by image in Python: the path until 2026-11-27
  uncached         one by one, without the cache; grey sources stay one channel through the crop and resize;
                   crop draws and CPU resizes without torchvision's per-call dispatch (the same draws and
                   pixels)
  rgb first        the same, but every image converted to RGB before the transform
  before           RGB first, crops drawn by torchvision's RandomResizedCrop.make_params and resized by
                   `F.resized_crop`: the path before 2026-11-23
The figure is the median over rounds of the mean ms per batch; every variant yields the same batches
(checked on the first batch of every round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import dmltrain.data.loader as loader_module  # noqa: E402
from dmltrain.data import SamplerSpec, TrainAugment, TrainLoader, ensure_glyphs, train_transform  # noqa: E402
from dmltrain.data.transforms import CropFlip  # noqa: E402


class OneByOneAugment(TrainAugment):
    """The path until 2026-11-27: every image's draws, crop and resize in Python, one image at a time."""

    def augment_many(self, prepared: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [self.augment(image) for image in prepared]


class TorchvisionAugment(OneByOneAugment):
    """The earlier TrainAugment: torchvision's make_params for the draw and F.resized_crop for the pixels."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._crop = v2.RandomResizedCrop(self.size, scale=self.scale, ratio=self.ratio, antialias=True)

    def draw(self, height: int, width: int) -> CropFlip:
        shape_only = torch.empty(1, dtype=torch.uint8).expand(1, height, width)
        box = self._crop.make_params([shape_only])
        flip = self.flip and bool(torch.rand(1) < 0.5)
        return CropFlip(box["top"], box["left"], box["height"], box["width"], flip)

    def _resized_crop(
        self, image: torch.Tensor, top: int, left: int, height: int, width: int
    ) -> torch.Tensor:
        size = [self.size, self.size]
        return F.resized_crop(image, top, left, height, width, size, self.interpolation, antialias=True)


@contextmanager
def rgb_first(enabled: bool) -> Iterator[None]:
    """Make the loader convert every image to RGB before its transform (the path before one-channel grey)."""
    original = loader_module.treats_channels_alike
    if enabled:
        loader_module.treats_channels_alike = lambda transform: False
    try:
        yield
    finally:
        loader_module.treats_channels_alike = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="prepared glyph shards (default: built under ./data/glyphs)")
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = Path(args.data) if args.data else Path(ensure_glyphs(Path("data") / "glyphs"))
    spec = SamplerSpec.from_config({"name": "pk", "samples_per_class": 4})
    crop = {"size": 32, "scale": (0.5, 1.0), "flip": False}  # the quickstart's data settings
    # name: (transform, RGB first, cache MB)
    variants: dict[str, tuple[Callable[[], TrainAugment], bool, int]] = {
        "cached": (lambda: train_transform(**crop), False, 1024),
        "cached, one by one": (lambda: OneByOneAugment(**crop), False, 1024),
        "uncached": (lambda: OneByOneAugment(**crop), False, 0),
        "rgb first": (lambda: OneByOneAugment(**crop), True, 0),
        "before": (lambda: TorchvisionAugment(**crop), True, 0),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        first: torch.Tensor | None = None
        for name, (make, rgb, cache_mb) in variants.items():
            loader = TrainLoader(
                data, 128, spec, num_workers=0, transform=make(), rank=0, world_size=1, cache_mb=cache_mb
            )
            with rgb_first(rgb):
                images = loader.next_batch()[0]
                if first is None:
                    first = images
                assert torch.equal(images, first), f"{name}: not the same batch as the cached path"
                for _ in range(loader.steps_per_epoch if cache_mb else 0):  # the pass that fills the cache
                    loader.next_batch()
                start = time.perf_counter()
                for _ in range(args.batches):
                    loader.next_batch()
                times[name].append((time.perf_counter() - start) / args.batches * 1e3)
    base = statistics.median(times["before"])
    print(
        f"loader CPU per batch of 128 (glyphs, 32 px), median of {args.rounds} rounds "
        f"x {args.batches} batches"
    )
    for name, values in times.items():
        ms = statistics.median(values)
        print(f"{name:<20} {ms:6.2f} ms   {base / ms:.2f}x the earlier path")


if __name__ == "__main__":
    main()
