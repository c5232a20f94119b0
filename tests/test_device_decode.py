"""Decoding on the training device (`decode="gpu"`, data.decode=gpu), checked on the CPU.

The loader workers draw each image's crop and flip and ship JPEG bytes; the training process decodes them in
batched `torchvision.io.decode_jpeg` calls and applies the same `TrainAugment.apply`. On a CPU device that
path runs with libjpeg, so everything but nvJPEG itself is checked here against the PIL path: the draws,
the tensor-side crop/resize/flip, determinism and resume, per-image fallback to PIL for PNG / grey / CMYK /
EXIF-rotated / unterminated JPEGs, and errors that name the sample and shard. tests/test_gpu_decode.py
checks nvJPEG. Real shards written by the project's own prepare path.
"""

from __future__ import annotations

import io
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from dmltrain.data import SamplerSpec, TrainLoader, load_dataset_info, train_transform
from dmltrain.data.conversion import prepare_dataset
from dmltrain.data.datasets.base import SourceDataset, SourceItem
from dmltrain.data.device_decode import (
    DeviceDecoder,
    EncodedPart,
    encode_part,
    on_the_host,
    resolve_decode,
)
from dmltrain.data.metadata import Evaluation
from dmltrain.data.shards import ShardEntry, read_shard, write_shard
from dmltrain.service.config import ConfigError, load_config
from dmltrain.service.prefetch import _pinned
from dmltrain.service.train import _decode_mode

REPO = Path(__file__).parents[1]
CPU = torch.device("cpu")
KINDS = ("jpeg", "progressive", "png", "grey", "cmyk", "trailing", "jpeg444", "rotated")
# Kinds the loader worker decodes itself (PIL), and the ones shipped encoded to the device decoder.
WORKER_KINDS = {"png", "grey", "cmyk", "trailing", "rotated"}


def pixels(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Smooth colour fields plus noise: JPEG-like content with edges and texture."""
    yy, xx = np.mgrid[0:height, 0:width]
    a, b, c = rng.uniform(0.02, 0.15, 3)
    base = np.stack([np.sin(a * xx), np.cos(b * yy), np.sin(c * (xx + yy))], axis=-1)
    return np.clip(127 + 90 * base + rng.normal(0, 12, (height, width, 3)), 0, 255).astype(np.uint8)


def encoded(array: np.ndarray, kind: str) -> bytes:
    """The image as a file of `kind` (one of KINDS)."""
    image = Image.fromarray(array)
    out = io.BytesIO()
    if kind == "png":
        image.save(out, format="PNG")
    elif kind == "grey":
        image.convert("L").save(out, format="JPEG", quality=90)
    elif kind == "cmyk":
        image.convert("CMYK").save(out, format="JPEG", quality=90)
    elif kind == "progressive":
        image.save(out, format="JPEG", quality=90, progressive=True)
    elif kind == "jpeg444":
        image.save(out, format="JPEG", quality=95, subsampling=0)
    elif kind == "rotated":  # EXIF orientation 6: PIL turns it upright (sides swapped), nvJPEG would not
        exif = Image.Exif()
        exif[0x0112] = 6
        image.save(out, format="JPEG", quality=90, exif=exif)
    else:
        image.save(out, format="JPEG", quality=90)
    data = out.getvalue()
    return data + b"camera maker notes" if kind == "trailing" else data


def build(root: Path, classes: int, per_class: int, kinds: tuple[str, ...], seed: int = 0) -> Path:
    """Shards of images 40-90 px a side (each its own size), kinds cycling over `kinds`, plus a test split."""
    rng = np.random.default_rng(seed)
    items = []
    for c in range(classes):
        for i in range(per_class):
            kind = kinds[(c * per_class + i) % len(kinds)]
            array = pixels(rng, int(rng.integers(40, 91)), int(rng.integers(40, 91)))
            items.append(SourceItem("train", f"c{c}", f"c{c}/{i}.{kind}", data=encoded(array, kind)))
    items += [
        SourceItem("test", f"t{c}", f"t{c}/{i}.jpg", data=encoded(pixels(rng, 48, 48), "jpeg"))
        for c in range(4)
        for i in range(3)
    ]
    source = SourceDataset("synthetic", items, [Evaluation(name="test", query="test")], ["train", "test"])
    prepare_dataset(
        lambda: source, root, source_format="synthetic", source_desc="tests", shard_size=8, progress=False
    )
    return root


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 classes x 6 colour JPEGs (baseline 4:2:0) in 12 shards."""
    return build(tmp_path_factory.mktemp("jpegs"), 16, 6, ("jpeg",))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """14 classes x 6 images cycling over every kind of file a shard may hold."""
    return build(tmp_path_factory.mktemp("mixed"), 14, 6, KINDS, seed=1)


def loader(
    root: Path,
    decode: str,
    workers: int = 2,
    batch: int = 16,
    seed: int = 3,
    device: torch.device = CPU,
    **options: Any,
) -> TrainLoader:
    """A 1-rank P x K loader at 32 px; decode="gpu" runs on `device` (the CPU unless a test says)."""
    return TrainLoader(
        root,
        batch,
        SamplerSpec(name="pk", samples_per_class=4, seed=seed),
        rank=0,
        world_size=1,
        num_workers=workers,
        image_size=32,
        decode=decode,  # type: ignore[arg-type]
        device=device if decode == "gpu" else None,
        with_keys=True,
        **options,
    )


def batches(root: Path, decode: str, steps: int, workers: int = 2, **options: Any) -> list[tuple]:
    source = loader(root, decode, workers, **options)
    try:
        return [source.next_batch() for _ in range(steps)]
    finally:
        source.close()


def assert_close_batches(a: list[tuple], b: list[tuple], max_diff: int, mean_diff: float) -> None:
    """Same samples (keys, labels) in the same order; pixels within the stated tolerance."""
    for x, y in zip(a, b, strict=True):
        assert x[3] == y[3] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
        assert x[0].shape == y[0].shape and x[0].dtype == y[0].dtype == torch.uint8
        diff = (x[0].float() - y[0].float()).abs()
        assert diff.max() <= max_diff and diff.mean() <= mean_diff, (diff.max(), diff.mean())


def test_train_augment_draws_what_torchvision_draws() -> None:
    """The split draw/apply is torchvision's RandomResizedCrop + RandomHorizontalFlip, draw for draw."""
    for flip in (True, False):
        pipeline = [v2.RandomResizedCrop(24, scale=(0.16, 1.0), antialias=True)]
        reference = v2.Compose(pipeline + ([v2.RandomHorizontalFlip()] if flip else []))
        augment = train_transform(24, scale=(0.16, 1.0), flip=flip)
        for shape in [(3, 40, 30), (3, 300, 500), (3, 17, 200)]:  # the last forces the centre-crop fallback
            image = torch.randint(0, 256, shape, dtype=torch.uint8)
            for seed in range(40):
                torch.manual_seed(seed)
                expected, after = reference(image), torch.rand(1)
                torch.manual_seed(seed)
                params = augment.draw(*shape[1:])
                assert torch.rand(1) == after  # the generator advanced exactly as torchvision's
                assert torch.equal(augment.apply(image, params), expected)
                torch.manual_seed(seed)
                assert torch.equal(augment(image), expected)
    # Warp mode (FastAP 5.1, Smooth-AP 5.3, RLL 4.1.2): the crop is drawn on the warped square.
    reference = v2.Compose([v2.Resize((32, 32), antialias=True), *pipeline, v2.RandomHorizontalFlip()])
    augment = train_transform(24, scale=(0.16, 1.0), resize_mode="warp", resize=32)
    image = torch.randint(0, 256, (3, 50, 80), dtype=torch.uint8)
    for seed in range(20):
        torch.manual_seed(seed)
        expected = reference(image)
        torch.manual_seed(seed)
        params = augment.draw(50, 80)
        assert params.top + params.height <= 32 and params.left + params.width <= 32
        assert torch.equal(augment.apply(image, params), expected)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_device_path_on_cpu_matches_the_pil_path(jpegs: Path, workers: int) -> None:
    """Same samples, crops and flips; decode_jpeg (libjpeg) + the tensor crop/resize/flip give PIL's pixels
    within 2 grey levels (on this machine they are identical)."""
    shard = load_dataset_info(jpegs).shard_urls(jpegs, "train")[0]
    part = encode_part(list(read_shard(shard)), train_transform(32))
    assert bool((part.sizes > 0).all()) and len(part.decoded) == 0  # all shipped encoded
    cpu, device = batches(jpegs, "cpu", 3, workers), batches(jpegs, "gpu", 3, workers)
    assert_close_batches(cpu, device, max_diff=2, mean_diff=0.1)
    assert device[0][0].device == CPU


def test_warp_mode_draws_and_applies_the_same_on_the_device_path(jpegs: Path) -> None:
    warp = train_transform(32, resize_mode="warp", resize=40)
    out = {}
    for decode in ("cpu", "gpu"):
        source = TrainLoader(
            jpegs,
            16,
            SamplerSpec(seed=3),
            rank=0,
            world_size=1,
            num_workers=0,
            transform=warp,
            decode=decode,  # type: ignore[arg-type]
            device=CPU if decode == "gpu" else None,
            with_keys=True,
        )
        out[decode] = [source.next_batch() for _ in range(2)]
    assert_close_batches(out["cpu"], out["gpu"], max_diff=2, mean_diff=0.1)


def test_every_kind_of_file_is_routed_per_image_and_matches_the_pil_path(mixed: Path) -> None:
    info = load_dataset_info(mixed)
    samples = [s for url in info.shard_urls(mixed, "train") for s in read_shard(url, with_meta=True)]
    part = encode_part(samples, train_transform(32))
    routed: dict[str, set[bool]] = {}
    for sample, size in zip(samples, part.sizes.tolist(), strict=True):
        kind = Path(json.loads(sample.meta or b"{}")["path"]).suffix[1:]
        routed.setdefault(kind, set()).add(size > 0)
    assert routed == {kind: {kind not in WORKER_KINDS} for kind in KINDS}
    assert len(part.decoded) == int((part.sizes == 0).sum()) > 0
    assert_close_batches(batches(mixed, "cpu", 3), batches(mixed, "gpu", 3), max_diff=2, mean_diff=0.1)


def test_gpu_mode_is_deterministic_and_resumes_exactly(jpegs: Path) -> None:
    first = loader(jpegs, "gpu")
    [first.next_batch() for _ in range(2)]
    state = first.state_dict()
    expected = [first.next_batch() for _ in range(3)]
    first.close()
    assert_close_batches(expected, batches(jpegs, "gpu", 5)[2:], max_diff=0, mean_diff=0.0)
    again = loader(jpegs, "gpu")
    again.load_state_dict(state)
    assert_close_batches([again.next_batch() for _ in range(3)], expected, max_diff=0, mean_diff=0.0)
    again.close()
    # The state is the same in both modes: a CPU-decoding run resumes a GPU-decoding one (and back).
    other = loader(jpegs, "cpu")
    other.load_state_dict(state)
    assert_close_batches([other.next_batch() for _ in range(3)], expected, max_diff=2, mean_diff=0.1)
    other.close()


def test_a_host_share_of_the_jpegs_is_decoded_in_the_workers_with_the_same_crops(jpegs: Path) -> None:
    """data.host_decode_share: that fraction of each part, spread evenly, decoded by PIL in the loader
    worker; the batches are the device path's up to the decoders (identical on the CPU), deterministic,
    and a run may change the share when it resumes (the loader state does not depend on it)."""
    assert [on_the_host(i, 0.25) for i in range(8)] == [False, False, False, True] * 2
    assert not any(on_the_host(i, 0.0) for i in range(8)) and all(on_the_host(i, 1.0) for i in range(8))
    samples = list(read_shard(load_dataset_info(jpegs).shard_urls(jpegs, "train")[0]))
    for share in (0.0, 0.25, 0.5, 1.0):
        part = encode_part(samples, train_transform(32), share)
        assert int((part.sizes == 0).sum()) == len(part.decoded) == int(len(samples) * share), share
    with pytest.raises(ValueError, match=r"host_share must be in \[0, 1\], got 1.5"):
        encode_part(samples, train_transform(32), 1.5)
    with pytest.raises(ValueError, match=r"host_decode_share must be in \[0, 1\], got -0.1"):
        loader(jpegs, "gpu", host_decode_share=-0.1)
    device_only = batches(jpegs, "gpu", 4)
    for share in (0.5, 1.0):
        shared = batches(jpegs, "gpu", 4, host_decode_share=share)
        assert_close_batches(shared, device_only, max_diff=2, mean_diff=0.1)
        assert_close_batches(shared, batches(jpegs, "gpu", 4, host_decode_share=share), 0, 0.0)
    first = loader(jpegs, "gpu", host_decode_share=0.5)
    [first.next_batch() for _ in range(2)]
    state = first.state_dict()
    first.close()
    again = loader(jpegs, "gpu", host_decode_share=0.25)
    again.load_state_dict(state)
    assert_close_batches([again.next_batch() for _ in range(2)], device_only[2:], 2, 0.1)
    again.close()


def _damaged(src: Path, dst: Path, damage) -> Path:
    """A copy of `src` whose train shards hold `damage(bytes)` instead of every image."""
    shutil.copytree(src, dst)
    info = load_dataset_info(dst)
    for url in info.shard_urls(dst, "train"):
        samples = list(read_shard(url))
        write_shard(url, [ShardEntry(s.key, damage(s.data), "jpg", s.cls, s.category, {}) for s in samples])
    return dst


def _without_scan(data: bytes) -> bytes:
    """A JPEG with a good header and end marker but no image data: only a full decode can tell."""
    return data[: data.index(b"\xff\xda")] + b"\xff\xd9"


def test_an_image_no_decoder_reads_is_named_by_sample_and_shard(jpegs: Path, tmp_path: Path) -> None:
    truncated = _damaged(jpegs, tmp_path / "truncated", lambda d: d[: len(d) // 2])
    # Without an end marker the worker hands the image to PIL, which refuses it (libjpeg would decode the
    # missing half as grey, silently).
    with pytest.raises(
        ValueError, match=r"sample '[^']+' of shard \S+\.tar: cannot decode/transform the image"
    ):
        loader(truncated, "gpu").next_batch()
    no_scan = _damaged(jpegs, tmp_path / "no_scan", _without_scan)
    # The header passes the worker's checks: the device decoder fails, alone too, then PIL; the error comes
    # out of the join thread in the caller.
    pattern = r"sample '[^']+' of shard \S+/train-\d+\.tar: cannot decode the image: .*device decoder"
    with pytest.raises(ValueError, match=pattern):
        loader(no_scan, "gpu").next_batch()
    with pytest.raises(ValueError, match=pattern):
        loader(no_scan, "gpu", workers=0).next_batch()


@pytest.mark.parametrize("workers", [0, 1])
def test_an_undecodable_image_on_the_device_path_ends_a_run_with_one_line_naming_it(
    jpegs: Path, tmp_path: Path, workers: int
) -> None:
    """As on the CPU path (tests/test_data_tar.py): every attempt would replay the same sample, so the
    error is one the worker loop does not retry, whether a loader worker found it (a truncated JPEG goes to
    PIL there) or the decode thread did (the device decoder and PIL both refuse it)."""
    from dmltrain.data.errors import SampleError
    from dmltrain.service.errors import FATAL_IN_LOOP, as_fatal

    for name, damage in (("truncated", lambda d: d[: len(d) // 2]), ("no_scan", _without_scan)):
        root = _damaged(jpegs, tmp_path / name, damage)
        with pytest.raises(SampleError) as caught:
            loader(root, "gpu", workers=workers).next_batch()
        assert isinstance(caught.value, FATAL_IN_LOOP)
        line = str(as_fatal(caught.value, 0, "step 1"))
        assert re.fullmatch(
            r"rank 0 step 1: SampleError: sample '[^']+' of shard \S+\.tar: cannot decode.* the image: .+",
            line,
        ), (name, line)


def test_an_image_the_device_decoder_refuses_is_decoded_by_pil(
    jpegs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The decoder retries alone, then PIL (logged, counted). Here the device "refuses" because the decoded
    shape differs from the header's, which is what the decoder checks after every decode."""
    urls = load_dataset_info(jpegs).shard_urls(jpegs, "train")
    samples = list(read_shard(urls[0], shard=0))[:4]
    augment = train_transform(32)
    torch.manual_seed(0)
    part = encode_part(samples, augment)
    reference = DeviceDecoder(augment, CPU, urls)(part, [s.key for s in samples])
    part.params[1, 5] += 1  # image height as the (lying) header says
    decoder = DeviceDecoder(augment, CPU, urls, decode_batch=3)
    with caplog.at_level(logging.WARNING, logger="dmltrain.data.device_decode"):
        images = decoder(part, [s.key for s in samples])
    assert decoder.fallbacks == 1 and torch.equal(images, reference)
    assert re.search(
        rf"sample '{samples[1].key}' of shard {re.escape(urls[0])}: the device decoder", caplog.text
    )


@pytest.mark.parametrize(("workers", "raised_by"), [(0, "torch"), (1, "torch"), (0, "torchvision")])
def test_a_gpu_out_of_memory_while_decoding_is_one_line_not_a_pil_fallback(
    jpegs: Path,
    workers: int,
    raised_by: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full GPU is not the images' fault: before, the decoder took the CUDA error for a refused batch and
    decoded every image with PIL, a warning each, until the step itself ran out. Now it leaves the loader
    as a `DecodeMemoryError` (still a CUDA out-of-memory error), which the worker loop turns into one line
    naming what to change. The GPU's failure is stood in for: this machine has no CUDA. torchvision's
    batched GPU decoder re-raises torch's error as a plain RuntimeError with a prefix (its C++ catches every
    error), which slipped past a check for the error type."""
    from dmltrain.data import device_decode
    from dmltrain.data.device_memory import DecodeMemoryError
    from dmltrain.service.train import device_memory_error

    account = "CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 79.19 GiB of "
    account += "which 20.00 MiB is free. Including non-PyTorch memory, this process has 79.1 GiB in use."

    def full_gpu(*args: Any, **kwargs: Any) -> Any:
        if raised_by == "torchvision":
            raise RuntimeError(f"Error while decoding JPEG images: {account}")
        raise torch.cuda.OutOfMemoryError(account)

    monkeypatch.setattr(device_decode, "decode_jpeg", full_gpu)
    source = loader(jpegs, "gpu", workers=workers)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="dmltrain.data.device_decode"),
            pytest.raises(DecodeMemoryError) as caught,
        ):
            source.next_batch()
    finally:
        source.close()
    assert isinstance(caught.value, torch.cuda.OutOfMemoryError) and "decoded by PIL" not in caplog.text
    config = load_config(
        REPO / "configs" / "sop_smoothap_b16k.yaml", ["model.weights=null", "data.decode=auto"]
    )
    assert str(device_memory_error(caught.value, config, evaluating=False)) == (
        "CUDA out of memory. Tried to allocate 96.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "20.00 MiB is free (decoding a batch's JPEGs on the GPU, data.decode=auto): lower train.chunk_size "
        "(now 256) to leave the decoder room beside the step, or set data.decode=cpu (the loader workers "
        "decode)"
    )


def test_encoded_parts_join_in_order(jpegs: Path) -> None:
    urls = load_dataset_info(jpegs).shard_urls(jpegs, "train")
    augment = train_transform(32)
    parts = [encode_part(list(read_shard(u, shard=i)), augment) for i, u in enumerate(urls[:3])]
    joined = EncodedPart.join(parts)
    keys = [s.key for u in urls[:3] for s in read_shard(u)]
    whole = DeviceDecoder(augment, CPU, urls)(joined, keys)
    pieces = [DeviceDecoder(augment, CPU, urls)(p, keys) for p in parts]
    assert len(joined) == len(keys) and torch.equal(whole, torch.cat(pieces))


def test_decode_settings_resolve_or_fail_in_one_line(jpegs: Path, tmp_path: Path) -> None:
    assert resolve_decode("cpu", None) == ("cpu", None)
    assert resolve_decode("gpu", "cpu") == ("gpu", CPU)  # the device path on the CPU, as tests use it
    with pytest.raises(ValueError, match="decode must be one of"):
        resolve_decode("nvjpeg", None)
    if not torch.cuda.is_available():
        assert resolve_decode("auto", None) == ("cpu", None)
        with pytest.raises(ValueError, match="needs a CUDA device, and none is visible"):
            resolve_decode("gpu", None)
    assert resolve_decode("auto", "cpu") == ("cpu", None)
    custom = v2.Compose([v2.RandomResizedCrop(32, antialias=True)])
    with pytest.raises(ValueError, match="must be a TrainAugment"):
        TrainLoader(
            jpegs, 16, {"name": "pk"}, rank=0, world_size=1, transform=custom, decode="gpu", device=CPU
        )
    auto = TrainLoader(jpegs, 16, {"name": "pk"}, rank=0, world_size=1, transform=custom, decode="auto")
    assert auto.decode == "cpu" and auto.decode_device is None
    # The service: data.decode=gpu needs GPU workers, refused in one line naming the keys.
    overrides = [f"data.root={jpegs}", "data.prepare=null", "data.decode=gpu", "scaling.use_gpu=false"]
    with pytest.raises(ConfigError) as caught:
        load_config(REPO / "configs" / "quickstart.yaml", overrides)
    assert "data.decode=gpu decodes on the training workers' GPUs, but scaling.use_gpu=false" in str(
        caught.value
    )
    assert load_config(REPO / "configs" / "quickstart.yaml", overrides[:2]).data.decode == "auto"
    # A share of the decoding for the loader workers means nothing when they decode everything.
    with pytest.raises(ConfigError) as caught:
        load_config(
            REPO / "configs" / "quickstart.yaml",
            [*overrides[:2], "data.decode=cpu", "data.host_decode_share=0.3"],
        )
    assert "data.host_decode_share=0.3 splits the decoding between the GPU" in str(caught.value)
    with pytest.raises(ConfigError, match=r"data\.host_decode_share"):
        load_config(REPO / "configs" / "quickstart.yaml", [*overrides[:2], "data.host_decode_share=2"])
    shared = load_config(REPO / "configs" / "quickstart.yaml", [*overrides[:2], "data.host_decode_share=0.3"])
    assert shared.data.host_decode_share == 0.3
    with pytest.raises(ValueError, match="data.decode=gpu but this worker's device is cpu"):
        _decode_mode("gpu", CPU)
    assert _decode_mode("auto", CPU) == "auto"


def test_the_prefetcher_leaves_a_batch_already_on_a_device_alone() -> None:
    """The service's pinned prefetch (used when the loader does not already decode a step ahead on the
    GPU) must not try to pin a device tensor: only host tensors are pinned."""
    on_device = torch.empty(2, device="meta")
    assert _pinned(on_device) is on_device and _pinned(["key"]) == ["key"]


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
@pytest.mark.parametrize("resize_mode", ["shorter_side", "warp"])
def test_batched_crops_are_torchvisions_off_cpu_path_pixel_for_pixel(
    monkeypatch: pytest.MonkeyPatch, interpolation: str, resize_mode: str
) -> None:
    """`TrainAugment.resample_batch` (what the device decoder runs on a GPU) against torchvision's own
    uint8 path off the CPU (cast to float, resample, clamp/round, cast back, per image; selected here by
    turning off its native CPU uint8 resize), image for image: identical pixels, crops and flips."""
    from torchvision.transforms.v2 import functional as F
    from torchvision.transforms.v2.functional import _geometry

    from dmltrain.data.transforms import CropFlip

    augment = train_transform(24, resize_mode=resize_mode, resize=32, interpolation=interpolation)
    rng = np.random.default_rng(0)
    shapes = [(40, 30), (300, 500), (17, 200), (24, 24), (32, 32), (61, 47)]
    images = [torch.from_numpy(pixels(rng, h, w)).permute(2, 0, 1).contiguous() for h, w in shapes * 4]
    torch.manual_seed(0)
    params = [augment.draw(*image.shape[-2:]) for image in images]
    side = 32 if resize_mode == "warp" else 24
    params[3] = CropFlip(0, 0, 24, 24, True)  # a crop of the output size: no resample
    params[4] = CropFlip(4, 2, min(side, 24), min(side, 24), False)
    params[5] = CropFlip(-3, -2, 30, 28, True)  # never drawn, but a box past the edge is padded, as there
    assert any(p.flip for p in params) and not all(p.flip for p in params)

    monkeypatch.setattr(_geometry, "_do_native_uint8_resize_on_cpu", lambda interpolation: False)
    expected = []
    for image, p in zip(images, params, strict=True):
        if augment.warp is not None:
            image = F.resize(image, [32, 32], interpolation=augment.interpolation, antialias=True)
        out = F.resized_crop(
            image, p.top, p.left, p.height, p.width, [24, 24], augment.interpolation, antialias=True
        )
        expected.append(F.horizontal_flip(out) if p.flip else out)
    batch = augment.resample_batch(images, params)
    assert batch.dtype == torch.uint8 and batch.shape == (len(images), 3, 24, 24)
    for i, image in enumerate(expected):
        assert torch.equal(batch[i], image), (i, params[i], (batch[i].float() - image.float()).abs().max())
    # On the CPU `apply_batch` is `apply` per image: the native uint8 resize, which rounds differently, by at
    # most one grey level per resample (two with the warp); nearest picks the same pixels either way.
    monkeypatch.undo()
    native = augment.apply_batch(images, params)
    assert torch.equal(
        native, torch.stack([augment.apply(x, p) for x, p in zip(images, params, strict=True)])
    )
    diff = (native.float() - batch.float()).abs()
    resamples = 0 if interpolation == "nearest" else 1 + (resize_mode == "warp")
    assert diff.max() <= resamples and diff.mean() <= 0.25 * resamples


def test_batched_crops_need_one_box_per_image() -> None:
    augment = train_transform(24)
    with pytest.raises(ValueError, match="2 images but 1 crop parameters"):
        augment.apply_batch([torch.zeros(3, 30, 30, dtype=torch.uint8)] * 2, [augment.draw(30, 30)])
    assert augment.apply_batch([], []).shape == (0, 3, 24, 24)
