"""The embedded default data set, built on first use: glyph shards rendered from matplotlib's typefaces.

Scanning (which characters, which faces) lives with the other converters in
`dmltrain.data.datasets.glyphs`; this module only builds the shards once, under a lock, through the same
`prepare` path a user's data takes.
"""

from __future__ import annotations

from pathlib import Path

from dmltrain.data.conversion import prepare_dataset
from dmltrain.data.datasets.glyphs import (
    DEFAULT_IMAGE_SIZE,
    DEFAULT_MIN_FACES,
    glyphs_source_desc,
    scan_glyphs,
)
from dmltrain.data.pools import available_cpus

__all__ = ["DEFAULT_IMAGE_SIZE", "DEFAULT_MIN_FACES", "ensure_glyphs"]


def ensure_glyphs(
    out_dir: str | Path,
    *,
    min_faces: int = DEFAULT_MIN_FACES,
    image_size: int = DEFAULT_IMAGE_SIZE,
    test_fraction: float = 0.5,
    seed: int = 0,
    shard_size: int | None = None,
    progress: bool = False,
    workers: int | None = None,
) -> Path:
    """Build the glyph shards into `out_dir` unless an identical build is there; returns `out_dir`.

    Safe to call from several processes at once: the build runs under a file lock and the second caller
    finds the finished `dataset.json`. `workers` processes render and write (default: the CPUs this
    process may use, up to 8; the same shards for any number).
    """
    workers = available_cpus() if workers is None else workers
    options = {"min_faces": min_faces, "image_size": image_size, "test_fraction": test_fraction, "seed": seed}
    desc = glyphs_source_desc(**options, shard_size=shard_size)
    prepare_dataset(
        lambda: scan_glyphs(**options, workers=workers),
        out_dir,
        source_format="glyphs",
        source_desc=desc,
        shard_size=shard_size,
        progress=progress,
        workers=workers,
        reuse_if=lambda info: info.source_format == "glyphs" and info.source == desc,
    )
    return Path(out_dir)
