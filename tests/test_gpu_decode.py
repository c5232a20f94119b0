"""nvJPEG decode + GPU crop/resize/flip against the PIL path, and a service run with data.decode=gpu
(`pytest -m gpu -s tests/test_gpu_decode.py` on a CUDA machine; `-s` prints the measured differences).

Skipped with a reason where CUDA is absent. Tolerance: decoders differ (IDCT, chroma upsampling), so pixels
are compared by their mean absolute difference: torchvision's own bound for nvJPEG against libjpeg (mean
< 2 grey levels, its test_decode_jpegs_cuda) for the augmented batches, which must also agree image by
image (every image < 4), which fails at once if a crop or a flip differed between the two paths; single
4:2:0 images of saturated colour differ more (chroma upsampling, up to 3.3 measured), 4:4:4 ones not at all.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from test_device_decode import build, encoded, loader, pixels
from test_gpu import has_faiss
from torchvision.io import ImageReadMode, decode_jpeg

from dmltrain.data import load_dataset_info, train_transform
from dmltrain.data.device_decode import (
    DeviceDecoder,
    EncodedPart,
    device_decode_problem,
    encode_part,
    resolve_decode,
)
from dmltrain.data.shards import read_shard
from dmltrain.data.transforms import decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA: run `pytest -m gpu` on a GPU machine"
    ),
]

REPO = Path(__file__).parents[1]
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def colour_jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 classes x 6 colour JPEGs of three kinds the device decodes (4:2:0, 4:4:4, progressive)."""
    return build(tmp_path_factory.mktemp("gpu_jpegs"), 16, 6, ("jpeg", "jpeg444", "progressive"))


def test_nvjpeg_decodes_like_pil_within_the_stated_bounds() -> None:
    """4:4:4 JPEGs decode alike (0.00 measured on an H100); 4:2:0 ones (baseline and progressive) differ
    where the chroma is upsampled (libjpeg's fancy upsampling vs nvJPEG's): 1.5-3.3 grey levels measured on
    these saturated colour fields, noise or none, so the bound is 4 (torchvision's own test photos stay
    under 2)."""
    assert device_decode_problem(CUDA) is None
    assert resolve_decode("auto", None) == ("gpu", torch.device("cuda", torch.cuda.current_device()))
    arrays = [pixels(np.random.default_rng(i), 64 + 7 * i, 96 - 5 * i) for i in range(8)]
    for kind, bound in (("jpeg", 4.0), ("jpeg444", 0.5), ("progressive", 4.0)):
        files = [encoded(a, kind) for a in arrays]
        tensors = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
        for f, image in zip(files, decode_jpeg(tensors, mode=ImageReadMode.RGB, device=CUDA), strict=True):
            reference = decode(f).float()
            assert image.device.type == "cuda" and image.shape == reference.shape
            diff = (image.cpu().float() - reference).abs().mean().item()
            print(f"{kind} {tuple(image.shape)}: mean |nvJPEG - PIL| = {diff:.3f}")
            assert diff < bound, (kind, diff)


def test_gpu_decoded_batches_match_the_pil_path(colour_jpegs: Path) -> None:
    """Same samples, crops and flips as the PIL path; pixels within the stated tolerance."""
    cpu_loader, gpu_loader = loader(colour_jpegs, "cpu"), loader(colour_jpegs, "gpu", device=CUDA)
    try:
        for _ in range(3):
            a, b = cpu_loader.next_batch(), gpu_loader.next_batch()
            assert a[3] == b[3] and torch.equal(a[1], b[1])
            assert b[0].device.type == "cuda" and b[0].dtype == torch.uint8 and b[0].shape == a[0].shape
            diff = (a[0].float() - b[0].cpu().float()).abs()
            per_image = diff.mean(dim=(1, 2, 3))
            mirrored = (a[0].float() - b[0].cpu().flip(-1).float()).abs().mean()
            print(
                f"batch: mean |GPU - PIL| {diff.mean():.3f}, worst image {per_image.max():.3f} "
                f"(against the mirrored batch: {mirrored:.3f})"
            )
            assert diff.mean() < 2 and per_image.max() < 4, (diff.mean(), per_image.max())
    finally:
        cpu_loader.close()
        gpu_loader.close()


def test_a_host_share_and_pinned_joins_give_the_same_batches(colour_jpegs: Path) -> None:
    """data.host_decode_share=0.5 with the service's pinned joins: half of each part decoded by PIL in the
    loader workers (exactly the PIL path's pixels), the rest by nvJPEG, joined into page-locked memory."""
    urls = load_dataset_info(colour_jpegs).shard_urls(colour_jpegs, "train")
    augment = train_transform(32)
    parts = [encode_part(list(read_shard(u, shard=i)), augment, 0.5) for i, u in enumerate(urls[:3])]
    joined = EncodedPart.join(parts, pin=True)
    assert joined.data.is_pinned() and joined.decoded.is_pinned() and len(joined.decoded) > 0
    plain = EncodedPart.join(parts)
    keys = [f"k{i}" for i in range(len(joined))]
    decoder = DeviceDecoder(augment, CUDA, urls)
    assert torch.equal(decoder(joined, keys), decoder(plain, keys))
    cpu_loader = loader(colour_jpegs, "cpu")
    shared = loader(colour_jpegs, "gpu", device=CUDA, pin_memory=True, host_decode_share=0.5)
    try:
        for _ in range(3):
            a, b = cpu_loader.next_batch(), shared.next_batch()
            assert a[3] == b[3] and torch.equal(a[1], b[1]) and b[0].device.type == "cuda"
            per_image = (a[0].float() - b[0].cpu().float()).abs().mean(dim=(1, 2, 3))
            exact = int((per_image == 0).sum())
            print(f"host share 0.5: {exact} of {len(per_image)} images exact, worst {per_image.max():.3f}")
            assert per_image.mean() < 2 and per_image.max() < 4 and exact >= len(per_image) // 3
    finally:
        cpu_loader.close()
        shared.close()


def test_repeated_device_decodes_are_identical_and_leave_earlier_batches_intact(colour_jpegs: Path) -> None:
    """Batches come off a side stream: one held by the caller must survive later decodes (allocator reuse
    is fenced by record_stream), and the device path is deterministic."""
    urls = load_dataset_info(colour_jpegs).shard_urls(colour_jpegs, "train")
    samples = [s for i, u in enumerate(urls[:4]) for s in read_shard(u, shard=i)]
    augment = train_transform(32)
    torch.manual_seed(0)
    part = encode_part(samples, augment)
    decoder = DeviceDecoder(augment, CUDA, urls, decode_batch=5)
    keys = [s.key for s in samples]
    first = decoder(part, keys)
    saved = first.cpu()
    for _ in range(5):
        assert torch.equal(decoder(part, keys), first)
    assert torch.equal(first.cpu(), saved) and decoder.fallbacks == 0
    reference = DeviceDecoder(augment, torch.device("cpu"), urls)(part, keys)
    assert (saved.float() - reference.float()).abs().mean() < 2


@pytest.mark.service
def test_service_runs_with_gpu_decode(ray_cluster, tmp_path: Path, colour_jpegs: Path) -> None:
    from mlflow.tracking import MlflowClient

    from dmltrain.service.config import load_config
    from dmltrain.service.run import launch

    if ray_cluster.cluster_resources().get("GPU", 0) < 1:
        pytest.skip("the local Ray cluster sees no GPU")
    config = load_config(
        REPO / "configs" / "quickstart.yaml",
        [
            f"data.root={colour_jpegs}",
            "data.prepare=null",
            "data.decode=gpu",
            "data.host_decode_share=0.5",  # half of the JPEGs decoded in the loader workers
            "data.loader_workers=2",
            "run.name=gpu-decode",
            f"run.storage_path={tmp_path / 'ray_results'}",
            f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
            "scaling.num_workers=1",
            "scaling.use_gpu=true",
            "train.steps=2",
            "train.log_every=1",
            "train.global_batch_size=32",
            "train.chunk_size=16",
            "train.eval_at_start=false",
            "train.compile=false",  # the decode path is under test; test_gpu.py's service run compiles
            f"eval.grid_queries={2 if has_faiss() else 0}",
        ],
    )
    outcome = launch(config)
    client = MlflowClient(outcome.tracking_uri)
    run = client.get_run(outcome.mlflow_run_id)
    assert run.info.status == "FINISHED"
    decoded_on = run.data.tags["dmltrain.data_decode"]
    assert decoded_on.startswith("gpu (cuda") and "0.5 of the images in the loader workers" in decoded_on, (
        decoded_on
    )
    losses = client.get_metric_history(outcome.mlflow_run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2] and all(math.isfinite(m.value) for m in losses)
    share = run.data.metrics["train/data_wait_share"]
    print(f"data wait share {share:.3f}")
    assert 0.0 <= share <= 1.0


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic"])
@pytest.mark.parametrize("resize_mode", ["shorter_side", "warp"])
def test_batched_crops_on_cuda_equal_apply_per_image(interpolation: str, resize_mode: str) -> None:
    """What the device decoder runs (`apply_batch`: one cast and one resample per image, rounding, flips and
    the cast back batched) gives exactly what torchvision's per-image path gives on the GPU."""
    augment = train_transform(32, resize_mode=resize_mode, interpolation=interpolation)
    rng = np.random.default_rng(1)
    shapes = [(120, 90), (300, 500), (37, 400), (64, 64), (333, 333)] * 6
    images = [torch.from_numpy(pixels(rng, h, w)).permute(2, 0, 1).to(CUDA) for h, w in shapes]
    torch.manual_seed(0)
    params = [augment.draw(*image.shape[-2:]) for image in images]
    batch = augment.apply_batch(images, params)
    expected = torch.stack([augment.apply(image, p) for image, p in zip(images, params, strict=True)])
    assert batch.device.type == "cuda" and torch.equal(batch, expected)
