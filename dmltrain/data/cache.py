"""`ShardCache`: one training loader worker's shards kept in memory after their first pass, as read and
decoded, when all of them fit.

Why: on a small data set (the quickstart's glyphs, CUB, Cars) every pass reads the same tar files and
decodes the same images again, and the loader's CPU is what the step pays for data where they share cores
(bench/service.py) or what sets the pace where a GPU steps faster than the loaders decode. From the second
pass on, a worker whose shards fit its budget reads no tar file and decodes no image: only the random
crops and flips are new each time, drawn and applied as before (the same batches, pixel for pixel).

All or nothing: a cache that can hold only part of a worker's shards would save only that part of the work
while holding its whole budget, so once the images seen so far say the worker's share will not fit (or it
outgrows the budget), the cache empties itself and stays off for the run.
"""

from __future__ import annotations

import logging

import torch

from dmltrain.data.shards import Sample

log = logging.getLogger(__name__)

# Images kept before the cache projects its final size from their mean (a few shards' worth), once for the
# shards read and once for the images decoded.
PROJECT_AFTER = 256
# Bytes a kept `Sample` costs beside its encoded image: the object and its key (sys.getsizeof on a glyph
# sample: 96 + 63, the bytes object's header 33; longer keys take more).
SAMPLE_OVERHEAD = 300


class ShardCache:
    """The samples of fully read shards (by shard index) and decoded images (by shard, member), within
    ``budget_bytes`` for the ``expected_images`` images of this worker's shards."""

    def __init__(self, budget_bytes: int, expected_images: int, where: str = "") -> None:
        self.budget_bytes = budget_bytes
        self.expected_images = max(1, expected_images)
        self.where = where
        self.enabled = budget_bytes > 0
        self.used_bytes = 0
        self._shards: dict[int, list[Sample]] = {}
        self._images: dict[tuple[int, int], torch.Tensor] = {}
        self._image_bytes = 0
        self._shard_bytes = 0
        self._shard_samples = 0

    def shard(self, shard: int) -> list[Sample] | None:
        """Every sample of ``shard`` in order, if it was read whole before."""
        return self._shards.get(shard)

    def keep_shard(self, shard: int, samples: list[Sample]) -> None:
        if self.enabled and shard not in self._shards:
            self._shards[shard] = samples
            size = sum(SAMPLE_OVERHEAD + len(s.data) + len(s.meta or b"") for s in samples)
            crossed = self._shard_samples < PROJECT_AFTER <= self._shard_samples + len(samples)
            self._shard_samples += len(samples)
            self._shard_bytes += size
            self._grow(size)
            if crossed:  # decoding on the GPU keeps no image here: the shards alone say whether they fit
                self._project()

    def image(self, sample: Sample) -> torch.Tensor | None:
        """The decoded (and prepared) image of ``sample``, if kept."""
        return self._images.get((sample.shard, sample.member)) if self.enabled else None

    def keep_image(self, sample: Sample, image: torch.Tensor) -> None:
        if not self.enabled or sample.shard < 0:
            return
        key = (sample.shard, sample.member)
        if key in self._images:
            return
        self._images[key] = image
        size = image.untyped_storage().nbytes()
        self._image_bytes += size
        self._grow(size)
        if len(self._images) == PROJECT_AFTER:
            self._project()

    def _project(self) -> None:
        """Turn off now if the mean image so far says this worker's share will not fit."""
        if not self.enabled:
            return
        per_image = self._image_bytes / max(1, len(self._images))
        per_image += self._shard_bytes / max(1, self._shard_samples)
        projected = per_image * self.expected_images
        if projected > self.budget_bytes:
            self._turn_off(f"its {self.expected_images} images would take about {projected / 2**20:.0f} MB")

    def _grow(self, size: int) -> None:
        self.used_bytes += size
        if self.enabled and self.used_bytes > self.budget_bytes:
            self._turn_off(f"what it holds passed {self.used_bytes / 2**20:.0f} MB")

    def _turn_off(self, why: str) -> None:
        log.info(
            "%s: loader cache off (%s, over its %.0f MB of data.cache_mb): shards are read and images "
            "decoded at every pass",
            self.where or "loader",
            why,
            self.budget_bytes / 2**20,
        )
        self.enabled = False
        self._shards.clear()
        self._images.clear()
        self.used_bytes = self._image_bytes = self._shard_bytes = self._shard_samples = 0
