"""Batch formation at a global batch the old loader could not form: B = 16,384 images (K = 4) from 8,000
train classes of ~5 images, over 2 ranks x 8 loader workers (issue 14's CPU check).

    python bench/sampler.py [--quick] [--classes 8000] [--batch 16384] [--ranks 2] [--workers 8]

Synthetic shards of tiny PNGs (12 x 12, 4-6 images a class) are written through dmltrain's own prepare
path, then both ranks' `TrainLoader`s run in this one process with explicit rank/world_size, each with
its own loader workers, and form real batches (read, sample, decode, augment to 8 px, join the parts).
Printed, from the same run:
- the plan: each worker's part, and the largest global batch each design forms on this data - now each
  rank's classes (one piece of at most K per class) bound it; before, one loader worker's classes had to
  fill a whole local batch (the nominal old ceiling is B <= C K / W);
- images/s of batch formation over both ranks, against decode + augment of the same bytes in this
  process (one core; the loaders use every core the machine gives them), and the CPU time per image of
  both (loader workers and main process together, from /proc), and, measured in one process, how a
  worker's CPU splits between sampling + tar reading and decode + augment (the robust figure);
- distinct classes and images per class in every global batch, and that every batch is exactly B;
- the main process's cost of joining the parts (torch.cat of one local batch), as a share of a step, and
  the copy rate at 224 px (the loader joins in a background thread, one step ahead of the caller);
- the encoded images the workers buffer (state of every worker: what "bounded by the pool" means here).
The machine may be shared: rates are rough, ratios come from this run.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import tempfile
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dmltrain.data import SamplerSpec, TrainLoader, decode, load_dataset_info, train_transform
from dmltrain.data.conversion import prepare_dataset
from dmltrain.data.datasets.base import SourceDataset, SourceItem
from dmltrain.data.loader import TrainStream, collate
from dmltrain.data.plan import check_batch
from dmltrain.data.sampling import largest_piece
from dmltrain.data.stream import GroupStream


def make_shards(root: Path, classes: int, seed: int = 0) -> float:
    """Write `classes` train classes of 4-6 tiny PNGs through the prepare path; returns seconds taken."""
    rng = np.random.default_rng(seed)
    items = []
    for c in range(classes):
        base = rng.integers(0, 256, 3)
        for i in range(int(rng.integers(4, 7))):
            pixels = np.clip(base + rng.normal(0, 40, (12, 12, 3)), 0, 255).astype(np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="PNG")
            items.append(SourceItem("train", f"c{c:05d}", f"c{c:05d}/{i}.png", data=out.getvalue()))
    source = SourceDataset("synthetic", items, [], ["train"])
    start = time.perf_counter()
    prepare_dataset(lambda: source, root, source_format="synthetic", source_desc="bench", progress=False)
    return time.perf_counter() - start


def old_ceiling(plan_holdings: list, k: int, ranks: int) -> int:
    """The largest global batch the old loader formed: one worker filled a whole local batch from its own
    classes (one piece of at most K each), so the smallest worker capacity bounded every rank."""
    return ranks * min(sum(largest_piece(n, k) for n in h.runs.values()) for h in plan_holdings)


def decode_rate(blobs: list[bytes], size: int) -> tuple[float, float]:
    """(images/s, CPU seconds an image) of decode + augment of the same bytes in this process, one
    thread: the baseline."""
    transform = train_transform(size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start, cpu = time.perf_counter(), time.process_time()
        for blob in blobs:
            transform(decode(blob))
        return len(blobs) / (time.perf_counter() - start), (time.process_time() - cpu) / len(blobs)
    finally:
        torch.set_num_threads(threads)


def worker_breakdown(
    root: Path, spec: SamplerSpec, args: argparse.Namespace, local: int
) -> tuple[float, float]:
    """CPU seconds an image of (sampling + tar reading, decode + augment) in one loader worker's part,
    measured in this process on rank 0's worker 0 (after one warm-up part): a same-process split."""
    loader = TrainLoader(
        root, local, spec, rank=0, world_size=args.ranks, num_workers=args.workers, image_size=8
    )
    stream = TrainStream(loader.urls, loader.plan, 0, loader.transform, {})
    holding = loader.plan.holdings[0]
    batcher = stream._batcher(GroupStream(loader.urls, holding.shards, 0, 0, loader.plan.shard_samples), 0)
    batcher.next_batch(0)
    sampling = decoding = 0.0
    images = 0
    for step in range(1, 3):
        t0 = time.process_time()
        samples = batcher.next_batch(step)
        t1 = time.process_time()
        collate(samples, loader.transform)
        sampling, decoding = sampling + t1 - t0, decoding + time.process_time() - t1
        images += len(samples)
    return sampling / images, decoding / images


def cpu_seconds() -> float:
    """CPU seconds of this process (all its threads) and its live children (the loader workers), from
    /proc: unlike wall time, barely moved by other jobs on a shared machine."""
    me, tick, total = os.getpid(), os.sysconf("SC_CLK_TCK"), 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return time.process_time() + total / tick


@dataclass
class Formed:
    """What forming `steps` global batches measured."""

    seconds: float
    cpu_seconds: float
    warm_seconds: float
    sizes: set[int]
    classes: list[int]
    per_class: Counter[int]
    join_seconds: float
    join_224_seconds: float
    buffered: list[int]


def form(root: Path, spec: SamplerSpec, args: argparse.Namespace, local: int, parts: list[int]) -> Formed:
    """Form `args.steps` global batches with every rank's loader in this process (after one warm-up)."""
    loaders = [
        TrainLoader(root, local, spec, rank=r, world_size=args.ranks, num_workers=args.workers, image_size=8)
        for r in range(args.ranks)
    ]
    start = time.perf_counter()
    warnings.filterwarnings("ignore", message="This DataLoader will create")  # more workers than cores
    for loader in loaders:  # starts the workers and primes their pools
        loader.next_batch()
    warm = time.perf_counter() - start
    sizes, classes, per_class = set(), [], Counter()
    start, cpu = time.perf_counter(), cpu_seconds()
    for _ in range(args.steps):
        batches = [loader.next_batch() for loader in loaders]
        labels = torch.cat([labels for _, labels, _ in batches])
        counts = Counter(labels.tolist())
        sizes.add(len(labels))
        classes.append(len(counts))
        per_class.update(counts.values())
    seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    pieces = list(torch.split(batches[0][0], [p for p in parts if p]))
    join = []
    for _ in range(3):  # what the main process adds per local batch: one torch.cat of the parts
        t0 = time.perf_counter()
        torch.cat(pieces)
        join.append(time.perf_counter() - t0)
    join_224 = join_seconds([p for p in parts if p], 224)
    states = [w for loader in loaders for w in loader.state_dict()["workers"].values()]
    for loader in loaders:
        loader.close()
    buffered = [len(w["batcher"]["refs"]) for w in states]
    return Formed(seconds, cpu, warm, sizes, classes, per_class, min(join), join_224, buffered)


def join_seconds(parts: list[int], size: int, limit: int = 1024) -> float:
    """Seconds to join parts of uint8 images at `size` px into one batch (the first `limit` images, so
    the figure fits in memory): what the main process adds per local batch at a real image size."""
    scale = min(1.0, limit / sum(parts))
    pieces = [
        torch.randint(0, 255, (max(1, round(p * scale)), 3, size, size), dtype=torch.uint8) for p in parts
    ]
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        torch.cat(pieces)
        best = min(best, time.perf_counter() - t0)
    return best / scale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classes", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=16384, help="global batch B")
    parser.add_argument("--k", type=int, default=4, help="sampler.samples_per_class")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=8, help="loader workers per rank")
    parser.add_argument("--steps", type=int, default=6, help="timed global batches (after one warm-up)")
    parser.add_argument("--data", type=Path, default=None, help="keep the shards here (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="1,000 classes, B=2,048, 3 steps")
    args = parser.parse_args()
    if args.quick:
        args.classes, args.batch, args.steps = 1000, 2048, 3
    with tempfile.TemporaryDirectory(prefix="bench-sampler-") as tmp:
        root = args.data or Path(tmp) / "shards"
        seconds = 0.0 if (root / "dataset.json").exists() else make_shards(root, args.classes)
        info = load_dataset_info(root)
        split = info.split("train")
        tar_bytes = sum(os.path.getsize(root / s.name) for s in split.shards) / split.num_samples
        print(
            f"data: {split.num_classes} train classes, {split.num_samples} images, {len(split.shards)} "
            f"shards (prepare {seconds:.1f} s); {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}"
        )
        spec = SamplerSpec(name="pk", samples_per_class=args.k, seed=0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = check_batch(info, "train", spec, args.batch, args.ranks, args.workers, where=str(root))
        assert plan.parts is not None
        w, k, need = args.workers, args.k, math.ceil(args.batch / args.k)
        new = args.ranks * min(sum(plan.capacity[r * w : (r + 1) * w]) for r in range(args.ranks))
        old = old_ceiling(plan.holdings, k, args.ranks)
        print(
            f"B={args.batch} (K={k}: {need} classes of {k}) over {args.ranks} ranks x {w} loader workers: "
            f"local batch {plan.batch_size}, parts {plan.parts[:w]} (rank 0)"
        )
        print(
            f"largest global batch that forms on this data: now {new} (a rank's classes), before {old} "
            f"(one worker's classes; nominal C*K/W = {split.num_classes * k // w}) -> {new / old:.1f}x"
        )
        blobs = _sample_blobs(root, 2000)
        before = decode_rate(blobs, 8)  # the baseline on both sides of the timed batches (shared machine)
        got = form(root, spec, args, plan.batch_size, plan.parts[:w])
        after = decode_rate(blobs, 8)
        raw, raw_cpu = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        sampling, decoding = worker_breakdown(root, spec, args, plan.batch_size)
    rate, step = args.steps * args.batch / got.seconds, got.seconds / args.steps
    print(f"warm-up (workers start, pools fill): {got.warm_seconds:.1f} s")
    cpu_image = got.cpu_seconds / (args.steps * args.batch)
    print(
        f"batch formation: {rate:,.0f} images/s over both ranks ({step:.2f} s per global batch); decode + "
        f"augment of the same bytes in this process on one core: {raw:,.0f} images/s (before "
        f"{before[0]:,.0f}, after {after[0]:,.0f}) -> {rate / raw:.2f}x"
    )
    print(
        f"CPU per image: batch formation {1e3 * cpu_image:.3f} ms (loader workers + main process), decode + "
        f"augment alone {1e3 * raw_cpu:.3f} ms -> {cpu_image / raw_cpu:.2f}x (separate time windows)"
    )
    print(
        f"in one worker's part (same process): sampling + tar reading {1e3 * sampling:.3f} ms an image, "
        f"decode + augment {1e3 * decoding:.3f} ms -> sampling takes {sampling / (sampling + decoding):.0%}"
    )
    print(
        f"every global batch holds {sorted(got.sizes)} images; distinct classes per batch "
        f"{min(got.classes)}..{max(got.classes)} (B/K = {need}); batches by images per class "
        f"{dict(sorted(got.per_class.items()))}"
    )
    image_bytes = 3 * 224 * 224
    print(
        f"joining {w} parts into a local batch of {plan.batch_size} images: {1e3 * got.join_seconds:.2f} ms "
        f"({got.join_seconds / step * 100:.2f}% of a global step); at 224 px the copy runs at "
        f"{image_bytes / got.join_224_seconds * plan.batch_size / 2**30:.2f} GiB/s here, "
        f"{plan.batch_size / got.join_224_seconds:,.0f} images/s (done in a thread, one step ahead)"
    )
    print(
        f"buffered per worker: {min(got.buffered)}..{max(got.buffered)} encoded images (default pool 8 x "
        f"part), about {max(got.buffered) * tar_bytes / 2**20:.1f} MiB at {tar_bytes:.0f} tar bytes an image"
    )


def _sample_blobs(root: Path, n: int) -> list[bytes]:
    from dmltrain.data.shards import read_shard

    out: list[bytes] = []
    for url in load_dataset_info(root).shard_urls(root, "train"):
        for sample in read_shard(url):
            out.append(sample.data)
            if len(out) == n:
                return out
    return out


if __name__ == "__main__":
    main()
