"""Converters from published data set layouts to the common `SourceDataset` (one module per layout)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from dmltrain.data.datasets.base import SourceDataset, SourceItem, SourceLayoutError

FORMATS = ("folder", "csv", "sop", "inshop", "vehicleid", "inaturalist", "cub", "cars", "glyphs")


def scan_source(fmt: str, source: str, **options: Any) -> SourceDataset:
    """Read the layout `fmt` at `source` (`-` for glyphs); options not used by `fmt` must be None."""
    scanners: dict[str, Callable[..., SourceDataset]] = _scanners()
    if fmt not in scanners:
        raise ValueError(f"unknown format {fmt!r}; choose from {', '.join(FORMATS)}")
    scanner, accepted = scanners[fmt]
    given = {k: v for k, v in options.items() if v is not None}
    unused = set(given) - set(accepted)
    if unused:
        raise ValueError(f"format {fmt!r} does not take option(s) {sorted(unused)}")
    if fmt == "glyphs":
        return scanner(**given)
    return scanner(Path(source).expanduser(), **given)


def _scanners() -> dict[str, Any]:
    from dmltrain.data.datasets.cars import scan_cars
    from dmltrain.data.datasets.csv_list import scan_csv
    from dmltrain.data.datasets.cub import scan_cub
    from dmltrain.data.datasets.folder import scan_folder
    from dmltrain.data.datasets.glyphs import scan_glyphs
    from dmltrain.data.datasets.inaturalist import scan_inaturalist
    from dmltrain.data.datasets.inshop import scan_inshop
    from dmltrain.data.datasets.sop import scan_sop
    from dmltrain.data.datasets.vehicleid import scan_vehicleid

    return {
        "folder": (scan_folder, ("test_fraction", "seed")),
        "csv": (scan_csv, ("image_root", "test_fraction", "seed")),
        "sop": (scan_sop, ()),
        "inshop": (scan_inshop, ()),
        "vehicleid": (scan_vehicleid, ()),
        "inaturalist": (scan_inaturalist, ("split_dir",)),
        "cub": (scan_cub, ()),
        "cars": (scan_cars, ()),
        "glyphs": (
            scan_glyphs,
            ("min_faces", "image_size", "test_fraction", "seed", "max_classes", "workers"),
        ),
    }


__all__ = ["FORMATS", "SourceDataset", "SourceItem", "SourceLayoutError", "scan_source"]
