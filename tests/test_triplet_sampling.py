"""Deep Ranking's online triplet sampler (Alg. 1) on real shards: the [q, p, n] layout the sampled triplet
loss scores, and an image-level stream order (the group stream delivers whole classes in a row)."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dmltrain.data import SamplerSpec, TrainLoader, prepare
from dmltrain.losses import TripletLoss

CLASSES = 40
IMAGES_PER_CLASS = 8


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 train classes x 8 tiny images in 10 categories of 4 classes."""
    root = tmp_path_factory.mktemp("triplets")
    rng = np.random.default_rng(0)
    (root / "img").mkdir()
    rows = []
    for c in range(CLASSES):
        for i in range(IMAGES_PER_CLASS):
            rel = f"img/c{c}_{i}.png"
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(root / rel)
            rows.append([rel, f"c{c}", f"cat{c % 10}", "train"])
    with (root / "list.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "class", "category", "split"])
        writer.writerows(rows)
    prepare("csv", str(root / "list.csv"), root / "out", shard_size=64, progress=False)
    return root / "out"


def test_triplet_batches_mix_many_classes_and_fit_the_sampled_loss(shards: Path) -> None:
    spec = SamplerSpec(name="triplet", pool_images=128, seed=2)
    loader = TrainLoader(shards, 30, spec, rank=0, world_size=1, num_workers=0, image_size=8)
    query_classes = []
    for _ in range(8):
        images, labels, _categories = loader.next_batch()
        q, p, n = labels[0::3], labels[1::3], labels[2::3]
        assert torch.all(q == p) and torch.all(q != n)
        query_classes.append(len(set(q.tolist())))
        embeddings = torch.nn.functional.normalize(images.flatten(1).float(), dim=1)
        assert TripletLoss(triplets="sampled").parts(embeddings, labels).count.item() == 10
    # Fed class by class, the 10 queries of a batch came from 1-2 classes (the groups just read); mixed
    # over a 64-image window of 8 classes they come from several.
    assert np.mean(query_classes) >= 4, query_classes
