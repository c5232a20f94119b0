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
"""

from dmltrain.data.embedded import ensure_glyphs
from dmltrain.data.loader import EvalLoader, TrainLoader
from dmltrain.data.metadata import DatasetInfo, Evaluation, damaged_shards, load_dataset_info
from dmltrain.data.plan import BatchError, check_batch
from dmltrain.data.prepare import prepare
from dmltrain.data.sampling import SamplerSpec
from dmltrain.data.transforms import TrainAugment, decode, test_transform, train_transform

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
