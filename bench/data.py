"""Data pipeline throughput: stream + decode + augment + class-balanced batching vs. the same decode + augment
on in-memory bytes (the ceiling) vs. torchvision ImageFolder + DataLoader, all in one process run; then the
tar reader alone vs. webdataset's and Python's `tarfile` readers on the same shards; with CUDA, the GPU
decode path (data.decode=gpu) against the CPU path.

    python bench/data.py [--quick] [--workers 2] [--gpu-batch 512] [--decode-device cuda|cpu]

The machine may be shared, so nothing is compared across separate time windows:
- in-process rows (0 loader workers) run interleaved batch by batch (raw, stream, ImageFolder, raw, ...),
  so load changes hit every row alike; each row also reports its CPU time per image, which contention
  barely moves. Ratios are against the raw decode + augment rate of the same rounds.
- worker rows start fresh loaders each round (a loader's workers would otherwise keep decoding in the
  background while another row is timed), warm up one batch per worker, then time the steady state; their
  baseline is the same decode + augment in the same number of worker processes. With fewer free cores
  than processes these rows measure the scheduler as much as the pipeline: read them as rough.
Columns: images/s over all timed batches; "vs raw" = ratio of those rates; "paired" = the ratio slot by
slot (a batch next to the baseline's batch, or a round), median and quartiles, robust to load bursts; CPU
time per image of the process (0-worker rows only: on a quiet machine it equals wall time there).
Goal (issue 4): streamed P x K batches at >= 0.9x the raw decode + augment rate, by all three measures.

The raw baseline runs exactly the pipeline's `decode` and `train_transform` on the same JPEG bytes and
keeps the images as a list: it pays for no batch tensor, no file reading and no sampling, so everything the
stream adds (reading the tar, grouping, sampling, the batch tensor, labels, sampler state) counts against it.
With workers the baseline stacks its batches too (in shared memory), as handing a batch over requires.

GPU rows (only where CUDA is present, or `--decode-device cpu` to exercise the same code on the CPU; the
script says when they are skipped): interleaved batch by batch, (1) the CPU path's decode + augment in one
process, (2) the training process's share of decode=gpu: batched `decode_jpeg` on the device + crop/resize/
flip there, on parts encoded beforehand, (2') the same with the crops applied image by image (torchvision's
`resized_crop` + flip per image, as before 2026-11-26; its CPU ms/image against (2) is the host work, and
GIL time, that batching the crops saves; on `--decode-device cpu` both run the CPU's per-image path),
(3) a loader worker's share of decode=gpu (image headers, crop draws, packing the bytes). Ratios against
(1) and against the raw decode + augment rate of the N-worker row above; the loader end to end with
decode=gpu joins the worker rows (same rounds, same baseline).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import tarfile
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets
from torchvision.transforms import v2
from webdataset import tariterators

from dmltrain.data import SamplerSpec, TrainLoader, decode, load_dataset_info, prepare, train_transform
from dmltrain.data.shards import Sample, read_shard
from dmltrain.data.transforms import CropFlip, TrainAugment, Transform


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


@dataclass
class Row:
    """A pipeline: `start()` gives an iterator of batch sizes. One entry per timed slot (a batch for the
    interleaved rows, a round for the worker rows) of images, wall seconds and CPU seconds."""

    name: str
    workers: int
    start: Callable[[], Iterator[int]]
    images: list[int] = field(default_factory=list)
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def rate(self) -> float:
        return sum(self.images) / sum(self.wall)

    def paired(self, base: Row) -> list[float]:
        """Rate ratio to `base` slot by slot: each pair ran back to back, under the same load."""
        return [
            (n / t) / (m / u)
            for n, t, m, u in zip(self.images, self.wall, base.images, base.wall, strict=True)
        ]

    def cpu_per_image(self) -> float:
        return sum(self.cpu) / sum(self.images)


def timed(iterator: Iterator[int]) -> tuple[int, float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    n = next(iterator)
    return n, time.perf_counter() - wall, time.process_time() - cpu


def run_interleaved(rows: list[Row], rounds: int, batches: int) -> None:
    """In-process rows, one batch each in turn (rotating who goes first), so they share the same load."""
    iterators = [row.start() for row in rows]
    for it in iterators:
        next(it)  # warm-up: buffers, first file reads
    for b in range(rounds * batches):
        for k in range(len(rows)):
            i = (k + b) % len(rows)
            n, wall, cpu = timed(iterators[i])
            rows[i].images.append(n)
            rows[i].wall.append(wall)
            rows[i].cpu.append(cpu)


def run_fresh(rows: list[Row], rounds: int, batches: int) -> None:
    """Worker rows: a new loader per round, one warm-up batch per worker, then `batches` timed batches."""
    for r in range(rounds):
        for k in range(len(rows)):
            row = rows[(k + r) % len(rows)]
            iterator = row.start()
            for _ in range(max(1, row.workers)):
                next(iterator)
            start = time.perf_counter()
            n = sum(next(iterator) for _ in range(batches))
            row.images.append(n)
            row.wall.append(time.perf_counter() - start)
            iterator.close()  # generator cleanup stops the worker processes before the next row
            del iterator


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, q2, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, q2, q3


class InMemory(Dataset):
    """The raw baseline for worker rows: decode + augment of in-memory bytes in the loader's workers."""

    def __init__(self, blobs: list[bytes], transform: Transform) -> None:
        self.blobs, self.transform = blobs, transform

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.transform(decode(self.blobs[i]))


def decode_device(args: argparse.Namespace) -> torch.device | None:
    """The device of the GPU rows: --decode-device, else CUDA where present, else None (rows skipped)."""
    if args.decode_device:
        return torch.device(args.decode_device)
    return torch.device("cuda") if torch.cuda.is_available() else None


def throughput_table(args: argparse.Namespace, tmp: Path, paths: list[Path]) -> tuple[float, float]:
    """Prints the pipeline table; returns the raw decode + augment CPU time per image (seconds) and the
    raw decode + augment rate of the worker rows (images/s; 0 without workers)."""
    transform = train_transform(args.crop, scale=(0.16, 1.0))
    blobs = [p.read_bytes() for p in paths]
    spec = SamplerSpec(name="pk", samples_per_class=4, pool_images=4 * args.batch)
    # a P x K batch needs B/K classes: the streamed decode=gpu row takes the largest the data allows
    stream_gpu_batch = min(args.gpu_batch, 4 * args.classes)
    gpu_spec = SamplerSpec(name="pk", samples_per_class=4, pool_images=4 * stream_gpu_batch)

    def raw() -> Iterator[int]:
        for start in itertools.count(0, args.batch):
            images = [transform(decode(blobs[(start + i) % len(blobs)])) for i in range(args.batch)]
            yield len(images)

    def raw_workers(workers: int) -> Callable[[], Iterator[int]]:
        def go() -> Iterator[int]:
            dataset = InMemory(blobs, transform)
            loader = DataLoader(
                dataset, batch_size=args.batch, shuffle=True, drop_last=True, num_workers=workers
            )
            while True:
                for images in loader:
                    yield len(images)

        return go

    def streamed(workers: int, device: torch.device | None = None) -> Callable[[], Iterator[int]]:
        def go() -> Iterator[int]:
            loader = TrainLoader(
                tmp / "shards",
                args.batch if device is None else stream_gpu_batch,
                spec if device is None else gpu_spec,
                rank=0,
                world_size=1,
                num_workers=workers,
                transform=transform,
                decode="cpu" if device is None else "gpu",
                device=device,
            )
            try:
                while True:
                    yield len(loader.next_batch()[1])
            finally:
                loader.close()

        return go

    def image_folder(workers: int) -> Callable[[], Iterator[int]]:
        pil_transform = v2.Compose([v2.PILToTensor(), transform])
        dataset = datasets.ImageFolder(str(tmp / "src"), transform=pil_transform)

        def go() -> Iterator[int]:
            loader = DataLoader(
                dataset, batch_size=args.batch, shuffle=True, num_workers=workers, drop_last=True
            )
            while True:
                for _, labels in loader:
                    yield len(labels)

        return go

    w = args.workers
    in_process = [
        Row("raw decode + augment (in-memory bytes)", 0, raw),
        Row("dmltrain stream + P x K batches", 0, streamed(0)),
        Row("torchvision ImageFolder + DataLoader", 0, image_folder(0)),
    ]
    parallel = [
        Row("raw decode + augment (in-memory bytes)", w, raw_workers(w)),
        Row("dmltrain stream + P x K batches", w, streamed(w)),
        Row("torchvision ImageFolder + DataLoader", w, image_folder(w)),
    ]
    device = decode_device(args)
    if device is not None:
        name = f"dmltrain stream + P x K batches, decode=gpu on {device} (batch {stream_gpu_batch})"
        parallel.append(Row(name, w, streamed(w, device)))
    load_before = os.getloadavg()[0]
    run_interleaved(in_process, args.rounds, args.batches)
    if w > 0:
        run_fresh(parallel, args.rounds, args.batches)
    else:
        parallel = []
    load_after = os.getloadavg()[0]

    print(
        f"{len(blobs)} JPEG {args.height}x{args.width} -> {args.crop}px crops, batch {args.batch}, "
        f"torch threads 1; {os.cpu_count()} cores, load average {load_before:.1f} -> {load_after:.1f}"
    )
    print(
        f"0-worker rows: {args.rounds * args.batches} batches each, interleaved; {w}-worker rows: "
        f"{args.rounds} rounds x {args.batches} batches, fresh loaders"
    )
    print("| pipeline | workers | images/s | vs raw | vs raw, paired: median [quartiles] | CPU ms/image |")
    print("|---|---|---|---|---|---|")
    raw_cpu = in_process[0].cpu_per_image()
    for group in (in_process, parallel):
        if not group:
            continue
        base = group[0]
        for row in group:
            q1, q2, q3 = quartiles(row.paired(base))
            cpu = (
                f"{1000 * row.cpu_per_image():.2f} ({raw_cpu / row.cpu_per_image():.2f}x)" if row.cpu else "-"
            )
            print(
                f"| {row.name} | {row.workers} | {row.rate():.0f} | {row.rate() / base.rate():.2f}x "
                f"| {q2:.2f}x [{q1:.2f}-{q3:.2f}] | {cpu} |"
            )
    stream = in_process[1]
    ratios = {
        "images/s": stream.rate() / in_process[0].rate(),
        "paired median": quartiles(stream.paired(in_process[0]))[1],
        "CPU time": raw_cpu / stream.cpu_per_image(),
    }
    verdict = "met" if min(ratios.values()) >= 0.9 else "NOT met"
    print(
        "\nstream vs raw decode + augment, 0 workers: "
        + ", ".join(f"{v:.2f}x by {k}" for k, v in ratios.items())
        + f" -> goal >= 0.9x {verdict}"
    )
    if parallel:
        print(
            f"{w} workers: raw decode + augment runs {parallel[0].rate() / in_process[0].rate():.2f}x the "
            f"1-process rate (ideal {w}x with {w} free cores); {w} workers + the main process on this "
            f"shared machine: rough figures"
        )
    return raw_cpu, parallel[0].rate() if parallel else 0.0


def device_table(args: argparse.Namespace, paths: list[Path], raw_workers_rate: float) -> None:
    """The GPU rows (see the module docstring); says so and returns when there is no CUDA device."""
    device = decode_device(args)
    if device is None:
        print(
            "\nGPU rows: skipped, no CUDA device here (torch.cuda.is_available() is False). On a CUDA "
            "machine they time batched nvJPEG decode + crop/resize/flip on the GPU against the CPU path; "
            "--decode-device cpu runs the same code on the CPU"
        )
        return
    from dmltrain.data.device_decode import DeviceDecoder, encode_part

    transform = train_transform(args.crop, scale=(0.16, 1.0))
    samples = [Sample(f"img{i}", p.read_bytes(), 0, 0, shard=0, url="memory") for i, p in enumerate(paths)]
    n = args.gpu_batch
    chunks = [samples[i : i + n] for i in range(0, len(samples) - n + 1, n)] or [samples]
    keys = [[s.key for s in chunk] for chunk in chunks]
    torch.manual_seed(0)
    parts = [encode_part(chunk, transform) for chunk in chunks]
    decoder = DeviceDecoder(transform, device, ["memory"], decode_batch=args.decode_batch)
    per_image = DeviceDecoder(
        CropsOneByOne(args.crop, scale=(0.16, 1.0)), device, ["memory"], decode_batch=args.decode_batch
    )

    def cpu_path() -> Iterator[int]:
        for chunk in itertools.cycle(chunks):
            yield len([transform(decode(s.data)) for s in chunk])

    def device_share() -> Iterator[int]:
        for part, names in itertools.cycle(zip(parts, keys, strict=True)):
            yield len(decoder(part, names))  # returns once the batch is on the device, finished

    def device_share_per_image() -> Iterator[int]:
        for part, names in itertools.cycle(zip(parts, keys, strict=True)):
            yield len(per_image(part, names))

    def worker_share() -> Iterator[int]:
        for chunk in itertools.cycle(chunks):
            yield len(encode_part(chunk, transform))

    rows = [
        Row("CPU path: PIL decode + augment (1 process)", 0, cpu_path),
        Row(f"decode=gpu, training process: decode_jpeg + crop/resize/flip on {device}", 0, device_share),
        Row("the same, crops applied image by image (before 2026-11-26)", 0, device_share_per_image),
        Row("decode=gpu, loader worker: headers + crop draws + packing (1 process)", 0, worker_share),
    ]
    load_before = os.getloadavg()[0]
    run_interleaved(rows, args.rounds, max(2, args.batches // 2))
    load_after = os.getloadavg()[0]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (the device path, not a GPU)"
    print(
        f"\nGPU rows on {name}: batches of {n} ({len(chunks)} distinct), decode_batch {args.decode_batch}, "
        f"{args.crop}px crops; interleaved, {len(rows[0].images)} batches each; load average "
        f"{load_before:.1f} -> {load_after:.1f}; CPU ms/image = host CPU time of this process"
    )
    print("| pipeline | images/s | vs CPU path | vs CPU path, paired: median [quartiles] | CPU ms/image |")
    print("|---|---|---|---|---|")
    base = rows[0]
    for row in rows:
        q1, q2, q3 = quartiles(row.paired(base))
        print(
            f"| {row.name} | {row.rate():.0f} | {row.rate() / base.rate():.2f}x "
            f"| {q2:.2f}x [{q1:.2f}-{q3:.2f}] | {1000 * row.cpu_per_image():.3f} |"
        )
    gpu, worker = rows[1].rate(), rows[3].rate()
    line = (
        f"\ndecode=gpu, training process: {gpu:.0f} images/s = {gpu / base.rate():.1f}x the CPU path in "
        "one process"
    )
    if raw_workers_rate:
        line += (
            f", {gpu / raw_workers_rate:.1f}x the raw CPU decode + augment in {args.workers} workers above"
        )
    print(
        line + f"; a loader worker's share runs at {worker:.0f} images/s a process (plus tar reading and "
        f"sampling), so {math.ceil(gpu / worker)} loader worker(s) keep up"
    )
    if decoder.fallbacks:
        print(f"({decoder.fallbacks} images fell back to PIL in the training process)")


class CropsOneByOne(TrainAugment):
    """The device decoder's crops as they ran before `apply_batch`: `apply` per image, then a stack."""

    def apply_batch(self, images: Sequence[torch.Tensor], params: Sequence[CropFlip]) -> torch.Tensor:
        return torch.stack([self.apply(image, p) for image, p in zip(images, params, strict=True)])


def to_sample(d: dict) -> Sample:
    """A webdataset dict sample as the `Sample` record the stream uses (so every reader does equal work)."""
    image = next(d[e] for e in ("jpg", "png", "webp") if e in d)
    return Sample(d["__key__"], image, int(d["cls"]), int(d.get("category", b"-1")))


def tarfile_samples(url: str) -> Iterator[Sample]:
    """Python's tarfile in stream mode (what webdataset uses underneath), grouped into samples here."""
    with open(url, "rb") as stream, tarfile.open(fileobj=stream, mode="r|") as archive:
        parts: dict[str, bytes] = {}
        key = None
        for info in archive:
            if not info.isreg():
                continue
            base, _, ext = info.name.partition(".")
            if key is not None and base != key:
                yield to_sample({"__key__": key, **parts})
                parts = {}
            key = base
            reader = archive.extractfile(info)
            assert reader is not None
            parts[ext] = reader.read()
        if key is not None:
            yield to_sample({"__key__": key, **parts})


def reader_table(tmp: Path, raw_cpu: float, repeats: int) -> None:
    """Reading shards into samples (no decode): CPU time per sample of each reader, same shards."""
    ours = load_dataset_info(tmp / "shards").shard_urls(tmp / "shards", "train")
    samples = [s for url in ours for s in read_shard(url)]
    per_shard = len(samples) // len(ours)
    with wds.ShardWriter(str(tmp / "wds-%04d.tar"), maxcount=per_shard, verbose=0) as writer:
        for s in samples:
            writer.write(
                {
                    "__key__": s.key,
                    "jpg": s.data,
                    "cls": str(s.cls).encode(),
                    "category": str(s.category).encode(),
                    "json": b"{}",
                }
            )
    theirs = sorted(str(p) for p in tmp.glob("wds-*.tar"))

    def hand(urls: list[str]) -> Iterator[Sample]:
        for url in urls:
            yield from read_shard(url)

    def wds_pipeline(urls: list[str]) -> Iterator[Sample]:
        for d in tariterators.tarfile_samples([{"url": u} for u in urls]):
            yield to_sample(d)

    def wds_dataset(urls: list[str]) -> Iterator[Sample]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=None)
        for d in dataset:
            yield to_sample(d)

    def plain_tarfile(urls: list[str]) -> Iterator[Sample]:
        for url in urls:
            yield from tarfile_samples(url)

    readers = [
        ("dmltrain `read_shard` (hand-written tar parser)", hand),
        ("webdataset 1.0.2 `tariterators.tarfile_samples`", wds_pipeline),
        ("webdataset 1.0.2 `WebDataset(urls)`, no decode", wds_dataset),
        ("Python `tarfile` stream mode (r|) + grouping", plain_tarfile),
    ]
    expected = [(s.key, s.cls, s.category, s.data) for s in samples]
    kib = sum(len(s.data) for s in samples) / len(samples) / 1024
    print(
        f"\nTar readers, {len(samples)} samples ({kib:.0f} KiB JPEG + cls + category + json each), "
        f"CPU us per sample, median of {repeats} interleaved runs"
    )
    print("| reader | dmltrain shards | webdataset ShardWriter shards | share of decode + augment |")
    print("|---|---|---|---|")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, reader in readers:
            for label, urls in (("ours", ours), ("theirs", theirs)):
                start = time.process_time()
                got = [(s.key, s.cls, s.category, s.data) for s in reader(urls)]
                times.setdefault((name, label), []).append((time.process_time() - start) / len(got))
                if got != expected:
                    raise AssertionError(f"{name} read different samples from the {label} shards")
    for name, _ in readers:
        a, b = (statistics.median(times[(name, label)]) for label in ("ours", "theirs"))
        print(
            f"| {name} | {1e6 * a:.0f} | {1e6 * b:.0f} | {100 * a / raw_cpu:.0f}-{100 * b / raw_cpu:.0f}% |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small data, fewer rounds (about a minute)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers for the parallel rows")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--gpu-batch", type=int, default=512, help="batch of the GPU rows (decode=gpu)")
    parser.add_argument("--decode-batch", type=int, default=512, help="images per decode_jpeg call")
    parser.add_argument(
        "--decode-device",
        default=None,
        help="device of the GPU rows (default: cuda if present, else skipped)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.height, args.width = 256, 320
    args.classes, per_class = (32, 16) if args.quick else (96, 16)
    args.rounds, args.batches = (3, 6) if args.quick else (5, 8)
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        paths = make_images(tmp / "src", args.classes, per_class, (args.height, args.width))
        prepare("folder", str(tmp / "src"), tmp / "shards", shard_size=64, progress=False)
        raw_cpu, raw_workers_rate = throughput_table(args, tmp, paths)
        device_table(args, paths, raw_workers_rate)
        reader_table(tmp, raw_cpu, repeats=3 if args.quick else 5)


if __name__ == "__main__":
    main()
