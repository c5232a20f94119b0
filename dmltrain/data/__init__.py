"""Data: WebDataset shards, dataset converters, class-level sampling on streams, transforms.

Public entry points (import from here):
- `load_dataset_info(root) -> DatasetInfo` reads `dataset.json`;
- `ensure_glyphs(out_dir) -> Path` builds the embedded glyph data set on first use;
- `TrainLoader(root, batch_size, sampler, rank=..., world_size=..., decode="cpu"|"gpu"|"auto", cache_mb=0)`
  sampled training batches, decoded in the loader workers or on the training GPU (`device_decode`); with
  `cache_mb` the workers keep their shards, read and decoded, after the first pass (`cache`);
- `check_batch(info, split, sampler, global_batch, world_size, loader_workers)` refuses a batch the data
  cannot fill (`BatchError`) from dataset.json alone, before any process starts;
- `EvalLoader(root, split, batch_size, rank=..., world_size=...)` a rank's part of a split;
- `train_transform(...)` (a `TrainAugment`: draws apart from pixel work), `test_transform(...)`,
  `SamplerSpec(...)`, `prepare(...)`.

The names load on first use (PEP 562): importing a light part of the package (``dmltrain.data.datasets``
for the list of formats, ``dmltrain.data.metadata``) does not import torch and torchvision, so a command
line can answer ``--help`` or refuse a mistake before they load (4 s on a 2-core machine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dmltrain.data.conversion import prepare
    from dmltrain.data.embedded import ensure_glyphs
    from dmltrain.data.loader import EvalLoader, TrainLoader
    from dmltrain.data.metadata import DatasetInfo, Evaluation, damaged_shards, load_dataset_info
    from dmltrain.data.plan import BatchError, check_batch
    from dmltrain.data.sampling import SamplerSpec
    from dmltrain.data.transforms import TrainAugment, decode, test_transform, train_transform

_HOMES = {
    "ensure_glyphs": "embedded",
    "EvalLoader": "loader",
    "TrainLoader": "loader",
    "DatasetInfo": "metadata",
    "Evaluation": "metadata",
    "damaged_shards": "metadata",
    "load_dataset_info": "metadata",
    "BatchError": "plan",
    "check_batch": "plan",
    "prepare": "conversion",
    "SamplerSpec": "sampling",
    "TrainAugment": "transforms",
    "decode": "transforms",
    "test_transform": "transforms",
    "train_transform": "transforms",
}

__all__ = [
    "BatchError",
    "DatasetInfo",
    "EvalLoader",
    "Evaluation",
    "SamplerSpec",
    "TrainAugment",
    "TrainLoader",
    "check_batch",
    "damaged_shards",
    "decode",
    "ensure_glyphs",
    "load_dataset_info",
    "prepare",
    "test_transform",
    "train_transform",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
