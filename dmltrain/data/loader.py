"""What the trainer and the evaluator iterate: `TrainLoader` (endless sampled batches, checkpointable) and
`EvalLoader` (each rank a disjoint part of a split, in order).

Every DataLoader worker runs a `GroupStream` + batcher on its own shards and fills its *part* of every
local batch (the plan sizes parts by what each worker holds), decoding and augmenting only those images.
The DataLoader hands worker outputs over in round-robin order, so the W parts of step s arrive one after
another and the main process joins them into the local batch (in a thread, one step ahead of the
caller): a batch draws on all of the rank's classes. Each part carries its worker's sampler state after
that step; the main process keeps the states of the last batch it *returned*, so `state_dict()`
describes exactly what the model has seen, whatever the workers had prefetched or joined ahead.

With ``decode="gpu"`` the workers ship their parts still encoded, with each image's crop and flip already
drawn, and the join thread decodes and augments the step's images on the training device
(`dmltrain.data.device_decode`): the same batches as the CPU path up to the JPEG decoders' differences.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import queue
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

from dmltrain.data.cache import ShardCache
from dmltrain.data.device_decode import (
    DecodeMode,
    DeviceDecoder,
    EncodedPart,
    OutBuffer,
    encode_part,
    encoded_fields,
    joined,
    resolve_decode,
)
from dmltrain.data.device_memory import DecodeMemoryError
from dmltrain.data.errors import SampleError, unusable_sample
from dmltrain.data.metadata import DatasetInfo, ShardInfo, load_dataset_info
from dmltrain.data.plan import TrainPlan
from dmltrain.data.sampling import Batcher, PoolBatcher, ReservoirBatcher, SamplerSpec, TripletBatcher
from dmltrain.data.shards import Sample, read_shard
from dmltrain.data.shared_memory import (
    encoded_bytes_per_image,
    eval_loader_bytes,
    shared_memory_explained,
    train_loader_bytes,
)
from dmltrain.data.slots import SlotReader, SlotRef, WorkerSlots, released_counter
from dmltrain.data.stream import GroupStream, rank_shards, resolve_rank
from dmltrain.data.transforms import (
    ResizeMode,
    TrainAugment,
    Transform,
    as_rgb,
    decode,
    output_side,
    test_transform,
    train_transform,
    treats_channels_alike,
)

log = logging.getLogger(__name__)

# normal: loader processes compete for the CPU like any process; idle: they run on cycles nothing else wants
# (Linux SCHED_IDLE, see `run_when_idle`).
WorkerPriority = Literal["normal", "idle"]

# 2: every worker fills a part of every step (1: each worker built whole batches of every W-th step), and
# shards go to ranks first, then to a rank's workers.
STATE_VERSION = 2


# Images are decoded a block at a time, then transformed: alternating PIL's decoder and torch's resize image
# by image cost about 45 us a switch (2-core AVX-512 EPYC, 1 thread, 128 glyphs of 64 px to 32 px crops:
# 18.3 ms a batch image by image, 12.6 ms in blocks of 32, 14.1 ms all 128 at once; the same with torch's
# AVX2 and default kernels, and no page faults either way). The transforms run in the same order, so they
# draw the same random numbers: the same pixels. The block bounds the decoded images held at once.
DECODE_BLOCK = 32


def collate(
    samples: list[Sample],
    transform: Transform,
    cache: ShardCache | None = None,
    out: OutBuffer | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode and transform ``samples`` into one batch. With ``cache`` and a `TrainAugment`, each image is
    decoded and prepared once and kept there while the cache is on (its random part never writes to its
    input; another transform might, so it gets a fresh decode every time). With ``out``, the images are
    stacked into ``out("images", shape, dtype)`` (a loader worker's reused shared buffer)."""
    images = []
    keep_grey = treats_channels_alike(transform)  # grey sources: one channel through the transform
    augment = transform if cache is not None and isinstance(transform, TrainAugment) else None
    for start in range(0, len(samples), DECODE_BLOCK):
        block = samples[start : start + DECODE_BLOCK]
        if augment is None:
            decoded = [_decode(sample, keep_grey) for sample in block]
        else:
            assert cache is not None
            decoded = [_prepared(sample, keep_grey, cache, augment) for sample in block]
        images.extend(_transformed(block, decoded, transform, prepared=augment is not None))
    shapes = sorted({tuple(i.shape) for i in images})
    if len(shapes) > 1:
        raise SampleError(f"transformed images differ in shape {shapes[:4]}: use a fixed-size transform")
    if out is not None and images:
        batch = torch.stack(images, out=out("images", (len(images), *shapes[0]), images[0].dtype))
    else:
        # default_collate stacks straight into shared memory inside a loader worker, which saves the copy
        # that sending an ordinary tensor to the main process would make.
        batch = default_collate(images)
    labels = torch.tensor([s.cls for s in samples], dtype=torch.int64)
    categories = torch.tensor([s.category for s in samples], dtype=torch.int64)
    return batch, labels, categories


def _transformed(
    block: list[Sample], decoded: list[Tensor], transform: Transform, prepared: bool
) -> list[Tensor]:
    """A block's images transformed, as RGB; ``prepared``: `TrainAugment.prepare` was applied already (the
    shard cache keeps them so). A `TrainAugment` takes the block in one call (`augment_many`, its compiled
    loop); should that fail, the generator is put back and the images go one by one, so that the error
    names the sample at fault. Either way the same draws in the same order: the same pixels."""
    if isinstance(transform, TrainAugment):
        state = torch.get_rng_state()
        try:
            inputs = decoded if prepared else [transform.prepare(image) for image in decoded]
            return [as_rgb(image) for image in transform.augment_many(inputs)]
        except Exception:
            torch.set_rng_state(state)
    out = []
    for sample, image in zip(block, decoded, strict=True):
        try:
            if prepared:
                assert isinstance(transform, TrainAugment)
                out.append(as_rgb(transform.augment(image)))
            else:
                out.append(as_rgb(transform(image)))
        except Exception as exc:
            raise unusable_sample(sample, exc) from exc
    return out


def run_when_idle(_worker_id: int = 0) -> None:
    """Put this process under SCHED_IDLE (DataLoader ``worker_init_fn``).

    Why: when the training step runs on the same cores (CPU training), a loader process that takes a core
    stalls the step's other intra-op threads at their next barrier, so it costs the step about twice its own
    CPU time. Under SCHED_IDLE it runs only where a core is idle, and any waking training thread preempts it
    at once; when the step waits for data its cores go idle, so the loader cannot starve.
    bench/service.py part 1 measures it. No-op (one debug line) where the OS has no SCHED_IDLE.
    """
    if not hasattr(os, "SCHED_IDLE"):
        log.debug("no SCHED_IDLE on this platform: loader workers keep their priority")
        return
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _decode(sample: Sample, keep_grey: bool) -> torch.Tensor:
    try:
        return decode(sample.data, keep_grey)
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError...
        raise unusable_sample(sample, exc) from exc


def _prepared(sample: Sample, keep_grey: bool, cache: ShardCache, augment: TrainAugment) -> Tensor:
    """``sample``'s decoded and prepared image from ``cache``, or made and kept there."""
    image = cache.image(sample)
    if image is None:
        image = _decode(sample, keep_grey)
        try:
            image = augment.prepare(image)
        except Exception as exc:
            raise unusable_sample(sample, exc) from exc
        cache.keep_image(sample, image)
    return image


def _as_is(item: Any) -> Any:
    """DataLoader collate_fn: batches are built in the worker; the default would walk the sampler state."""
    return item


class TrainStream(IterableDataset):
    """Runs inside each DataLoader worker: stream -> batcher -> decode + augment -> part + sampler state."""

    def __init__(
        self,
        urls: list[str],
        plan: TrainPlan,
        rank: int,
        transform: Transform,
        worker_states: dict[int, dict[str, Any]],
        decode: str = "cpu",
        cache_bytes: int = 0,
        host_decode_share: float = 0.0,
        released: Tensor | None = None,
        slot_depth: int = 3,
    ) -> None:
        """decode: "cpu" decodes and augments each part here; "gpu" draws the augmentation and ships the
        part encoded (`transform` must then be a `TrainAugment`), but for `host_decode_share` of its
        images, decoded here (`encode_part`). cache_bytes: each worker's `ShardCache` (0: none).
        released: in a worker process, parts go through `slot_depth` reused shared buffers per field
        (`dmltrain.data.slots`), this being the shared counter of the steps the reader has released."""
        super().__init__()
        self.urls, self.plan, self.rank, self.transform = urls, plan, rank, transform
        self.worker_states = worker_states
        self.decode = decode
        self.cache_bytes = cache_bytes
        self.host_decode_share = host_decode_share
        self.released, self.slot_depth = released, slot_depth

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        consumer = self.rank * self.plan.workers + worker
        seed = self.plan.spec.seed
        held = self.plan.holdings[consumer]
        cache = None
        if self.cache_bytes > 0:
            cache = ShardCache(self.cache_bytes, held.images, self.plan.name(consumer))
        stream = GroupStream(
            self.urls, held.shards, seed, consumer, self.plan.shard_samples, cache, self.plan.shard_classes
        )
        batcher = self._batcher(stream, consumer)
        slots = None
        if info is not None and self.released is not None:
            slots = WorkerSlots(self.slot_depth, self.released)
        step = 0
        state = self.worker_states.get(worker)
        if state is not None:
            stream.load_state_dict(state["stream"])
            batcher.load_state_dict(state["batcher"])
            step = int(state["step"])
        while True:
            samples = batcher.next_batch(step)
            part = None
            if samples:
                with torch.random.fork_rng(devices=[]):
                    # Only the CPU generator: torch.manual_seed also queues lazy CUDA/MPS seeding with a
                    # formatted stack trace on every call (0.4 ms, against 2 us for the CPU generator alone).
                    torch.default_generator.manual_seed(
                        int(np.random.SeedSequence([seed, consumer, step]).generate_state(1)[0])
                    )
                    out = functools.partial(slots.out, step) if slots is not None else None
                    if self.decode == "gpu":
                        assert isinstance(self.transform, TrainAugment)
                        part = encode_part(samples, self.transform, self.host_decode_share, out)
                    else:
                        part = collate(samples, self.transform, cache, out)
                if slots is not None:
                    part = _Shipped.of(part, slots, step)
            step += 1
            state = {"step": step, "stream": stream.state_dict(), "batcher": batcher.state_dict()}
            yield part, [s.key for s in samples], worker, step - 1, state

    def _batcher(self, stream: GroupStream, consumer: int) -> Batcher:
        plan, spec = self.plan, self.plan.spec
        seed = int(np.random.SeedSequence([spec.seed, 3, consumer]).generate_state(1)[0])
        where = plan.name(consumer)
        held = plan.holdings[consumer]
        if spec.name in ("pk", "random"):
            assert plan.parts is not None
            return PoolBatcher(
                stream,
                plan.parts[consumer],
                spec,
                seed,
                where,
                held.classes,
                held.images,
                plan.capacity[consumer],
                plan.turns(consumer),
            )
        if spec.name == "triplet":
            assert plan.parts is not None
            return TripletBatcher(stream, plan.parts[consumer], spec, seed, where, plan.local_share(consumer))
        return ReservoirBatcher(
            stream,
            spec,
            seed,
            where,
            lambda step: plan.quota(step, consumer),
            held.categories,
            plan.largest_quota(consumer),
            plan.typical_part(consumer),
        )


# (step, (images, labels, categories) or an EncodedPart, keys, each worker's state after its part)
_Step = tuple[int, Any, list[str], dict[int, dict[str, Any]]]


def _read_step(
    iterator: Iterator[Any],
    workers: int,
    steps: Iterator[int],
    pin: bool = False,
    slots: SlotReader | None = None,
) -> _Step:
    """The W parts of the next step from the DataLoader (which hands worker outputs over in round-robin
    order), joined: (step, (images, labels, categories) or one EncodedPart, keys, worker states). With
    `pin`, decoded parts (and encoded parts' bytes and images) are joined straight into page-locked
    memory (`joined`, `EncodedPart.join`). Parts shipped through `slots` are views of the workers'
    buffers: always copied by the join, then released to the workers."""
    expected_step = next(steps)
    parts, keys, states = [], [], {}
    for expected in range(workers):
        part, part_keys, worker, step, state = next(iterator)
        if (worker, step) != (expected, expected_step):
            raise RuntimeError(
                f"loader order broken: expected worker {expected} at step {expected_step}, got worker "
                f"{worker} at step {step}"
            )
        if isinstance(part, _Shipped):
            assert slots is not None
            part = part.views(slots, worker)
        if part is not None:
            parts.append(part)
        keys += part_keys
        states[worker] = state
    copy = slots is not None
    if parts and isinstance(parts[0], EncodedPart):
        batch: Any = EncodedPart.join(parts, pin, copy)
    else:
        batch = tuple(joined(t, pin, copy) for t in zip(*parts, strict=True))
    if slots is not None:
        slots.release(expected_step)
    return expected_step, batch, keys, states


def _finish_step(decoder: DeviceDecoder | None, item: _Step) -> _Step:
    """Decode a step's encoded parts on the device (in the join thread when there is one)."""
    step, joined, keys, states = item
    if isinstance(joined, EncodedPart):
        assert decoder is not None
        try:
            images: Tensor = decoder(joined, keys)
        except torch.cuda.OutOfMemoryError as exc:
            raise DecodeMemoryError(str(exc)) from exc
        joined = (images, joined.labels, joined.categories)
    return step, joined, keys, states


@dataclass
class _Shipped:
    """A worker's part as references to its shared buffers (`dmltrain.data.slots`), rebuilt as views."""

    encoded: bool  # an EncodedPart, else (images, labels, categories)
    refs: dict[str, SlotRef]

    @staticmethod
    def of(part: Any, slots: WorkerSlots, step: int) -> _Shipped:
        if isinstance(part, EncodedPart):
            tensors = {f: getattr(part, f) for f in encoded_fields()}
        else:
            tensors = dict(zip(_FIELDS, part, strict=True))
        return _Shipped(isinstance(part, EncodedPart), slots.ship(step, tensors))

    def views(self, slots: SlotReader, worker: int) -> Any:
        tensors = slots.tensors(worker, self.refs)
        return EncodedPart(**tensors) if self.encoded else tuple(tensors[f] for f in _FIELDS)


_FIELDS = ("images", "labels", "categories")


class _JoinAhead:
    """Reads and joins the parts of the next step in a background thread while the caller trains on the
    current one: torch.cat releases the GIL, so the copy (about 150 KB an image at 224 px) leaves the
    caller's critical path. All sampling (and, decoding on the CPU, all decoding) stays in the loader
    worker processes; `finish` (decoding on the device) runs here too, one step ahead."""

    def __init__(self, read: Callable[[], _Step]) -> None:
        """read: the next step's batch, read and joined (`_read_step`), then finished (decoded on the
        device, `_finish_step`)."""
        self._queue: queue.Queue[_Step | BaseException] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(read,), daemon=True)
        self._thread.start()

    def _run(self, read: Callable[[], _Step]) -> None:
        while not self._stop.is_set():
            try:
                item: _Step | BaseException = read()
            except BaseException as exc:  # handed to the caller, with its traceback
                item = exc
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def get(self) -> _Step:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Stop after the step being read; the DataLoader (and its workers) go with the thread."""
        self._stop.set()


class TrainLoader:
    """Endless class-structured batches `(images uint8 (B,C,H,W), labels int64 (B,), categories int64 (B,))`
    for one rank; `for batch in loader` runs one epoch (`steps_per_epoch` steps) and the next loop
    continues the stream. `state_dict()`/`load_state_dict()` resume it exactly (per rank). A batch the
    data cannot fill raises `plan.BatchError` here (`plan.check_batch` finds it before any worker starts).

    decode: "cpu" (PIL in the loader workers; images on the host), "gpu" (the workers draw the crops and
    ship JPEG bytes; images are decoded and augmented on `device`, default the current CUDA device, and
    returned there) or "auto" (gpu where `device` is CUDA and torchvision decodes JPEGs on it, else cpu).
    Both give the same crops for a seed, and the same loader state. `decode_batch` images are decoded
    per device call (it bounds the memory full-size decoded images take on the device).
    worker_priority="idle" runs the loader processes under SCHED_IDLE (`run_when_idle`): for CPU training,
    where they share the step's cores. cache_mb: memory the loader workers together may keep their shards
    in after the first pass, read and (decoding on the CPU) decoded, each its equal share, when all of its
    shards fit (`dmltrain.data.cache`); 0 = off. The batches are the same whatever these two are.
    pin_memory: join each batch straight into page-locked memory (for asynchronous copies to a CUDA
    device; needs CUDA), in the join thread when there is one (`joins_ahead`): one host copy a step instead
    of joining and then pinning. With decode "gpu" (batches are returned on the device) the same holds for
    the encoded bytes and the images the workers decoded, on their way to the device decoder.
    host_decode_share: with decode "gpu", the fraction of each part's images the loader workers still
    decode and augment with PIL (spread evenly, the same positions every step): one host thread drives the
    device decodes, and on a fast GPU it can set the step's pace while the workers have cores to spare.
    0 = every JPEG on the device, 1 = all in the workers; the same crops either way.
    """

    def __init__(
        self,
        root: str | Path,
        batch_size: int,
        sampler: SamplerSpec | Any = None,
        *,
        split: str = "train",
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 2,
        transform: Transform | None = None,
        image_size: int = 224,
        crop_scale: tuple[float, float] = (0.16, 1.0),
        resize_mode: ResizeMode = "shorter_side",
        resize: int | None = None,
        with_keys: bool = False,
        info: DatasetInfo | None = None,
        prefetch_factor: int = 2,
        multiprocessing_context: str | None = None,
        decode: DecodeMode = "cpu",
        device: torch.device | str | None = None,
        decode_batch: int = 512,
        worker_priority: WorkerPriority = "normal",
        cache_mb: int = 0,
        pin_memory: bool = False,
        host_decode_share: float = 0.0,
    ) -> None:
        self.spec = sampler if isinstance(sampler, SamplerSpec) else SamplerSpec.from_config(sampler or {})
        if batch_size < 2:
            raise ValueError(f"local batch size must be >= 2, got {batch_size}")
        if cache_mb < 0:
            raise ValueError(f"cache_mb must be >= 0, got {cache_mb}")
        self.root = str(root)
        self.info = info or load_dataset_info(root)
        self.split = split
        self.batch_size = batch_size
        self.rank, self.world_size = resolve_rank(rank, world_size)
        self.num_workers = num_workers
        self.workers = max(1, num_workers)
        self.transform = transform or train_transform(
            image_size, scale=crop_scale, resize_mode=resize_mode, resize=resize
        )
        self.image_size = output_side(self.transform, image_size)
        self.decode, self.decode_device = resolve_decode(decode, device)
        if self.decode == "gpu" and not isinstance(self.transform, TrainAugment):
            if decode == "gpu":
                raise ValueError(
                    "decode='gpu' draws the crops in the loader workers and applies them on the device: "
                    "the transform must be a TrainAugment (dmltrain.data.train_transform), not a custom one"
                )
            self.decode, self.decode_device = "cpu", None
        self.with_keys = with_keys
        self.prefetch_factor = prefetch_factor
        self.multiprocessing_context = multiprocessing_context
        if worker_priority not in ("normal", "idle"):
            raise ValueError(f"worker_priority must be 'normal' or 'idle', got {worker_priority!r}")
        self.worker_priority = worker_priority
        self.cache_mb = cache_mb
        self.pin_memory = pin_memory
        if self.pin_memory and not torch.cuda.is_available():
            raise ValueError("pin_memory=True joins batches into page-locked memory, which needs CUDA")
        if not 0.0 <= host_decode_share <= 1.0:
            raise ValueError(f"host_decode_share must be in [0, 1], got {host_decode_share}")
        self.host_decode_share = host_decode_share
        self.plan = TrainPlan(
            self.info, split, self.spec, batch_size, self.world_size, self.workers, where=self.root
        )
        self.steps_per_epoch = self.plan.steps_per_epoch
        self.urls = self.info.shard_urls(self.root, split)
        self.step = 0
        self._worker_states: dict[int, dict[str, Any]] = {}
        self._source: Callable[[], _Step] | None = None
        self._joiner: _JoinAhead | None = None
        self._dropped: weakref.finalize | None = None  # stops the join thread when the loader is dropped
        self._decoder: DeviceDecoder | None = None
        self._slots: SlotReader | None = None
        if self.decode == "gpu":
            assert isinstance(self.transform, TrainAugment) and self.decode_device is not None
            self._decoder = DeviceDecoder(self.transform, self.decode_device, self.urls, decode_batch)

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for _ in range(self.steps_per_epoch):
            yield self.next_batch()

    @property
    def joins_ahead(self) -> bool:
        """Whether a background thread reads (and joins, pins or decodes) the next step's batch while the
        caller trains on this one. Decoding on the device is worth a thread even for one worker; with no
        worker process the stream runs in the caller's process and seeds torch's generator per part, so
        it stays in the caller's thread."""
        return self.workers > 1 or (self._decoder is not None and self.num_workers > 0)

    def next_batch(self) -> tuple[Any, ...]:
        """The next local batch: the parts of this step from every loader worker, joined in worker order."""
        if self._source is None:
            iterator = iter(self._dataloader())
            steps = itertools.count(self.step)
            read = functools.partial(_read_step, iterator, self.workers, steps, self.pin_memory, self._slots)
            finish = functools.partial(_finish_step, self._decoder)
            if self.joins_ahead:
                # The thread holds the DataLoader but not this loader, so a loader dropped without close()
                # stops it and, with it, its worker processes (they lived as long as the process did).
                self._joiner = _JoinAhead(lambda: finish(read()))
                self._dropped = weakref.finalize(self, self._joiner.close)
                self._source = self._joiner.get
            else:  # one part is the batch: nothing to join, and no thread beside the caller's RNG use
                self._source = lambda: finish(read())
        with shared_memory_explained(self.shared_memory_bytes, "this rank's training loader"):
            step, (images, labels, categories), keys, states = self._source()
        if len(labels) != self.batch_size or step != self.step:
            raise RuntimeError(f"step {self.step}: got step {step} with {len(labels)} images")
        self._worker_states = states
        self.step += 1
        return (images, labels, categories, keys) if self.with_keys else (images, labels, categories)

    def shared_memory_bytes(self) -> int:
        """About what this loader's worker processes hold in shared memory once running (their buffers for
        `prefetch_factor` + 1 steps: `dmltrain.data.shared_memory`)."""
        return train_loader_bytes(
            self.batch_size,
            self.num_workers,
            self.image_size,
            decode="gpu" if self.decode == "gpu" else "cpu",
            host_decode_share=self.host_decode_share,
            encoded_bytes_per_image=encoded_bytes_per_image(self.info, self.split),
            prefetch_factor=self.prefetch_factor,
        )

    def _dataloader(self) -> DataLoader:
        """A DataLoader from the current state; with worker processes, their parts come through shared
        buffers reused every `prefetch_factor` + 1 steps (`dmltrain.data.slots`): while this process joins
        step s, a worker may write at most steps s+1 ... s+prefetch_factor (the DataLoader asks it for one
        step more each time this process takes one), so it never waits for a buffer."""
        released = released_counter(self.step) if self.num_workers > 0 else None
        self._slots = SlotReader(released) if released is not None else None
        dataset = TrainStream(
            self.urls,
            self.plan,
            self.rank,
            self.transform,
            dict(self._worker_states),
            self.decode,
            (self.cache_mb << 20) // self.workers,
            self.host_decode_share,
            released,
            self.prefetch_factor + 1,
        )
        extra: dict[str, Any] = {}
        if self.num_workers > 0:
            extra = {
                "prefetch_factor": self.prefetch_factor,
                "multiprocessing_context": self.multiprocessing_context,
                "worker_init_fn": run_when_idle if self.worker_priority == "idle" else None,
            }
        return DataLoader(dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is, **extra)

    def _signature(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "world_size": self.world_size,
            "workers": self.workers,
            "sampler": self.spec.to_dict(),
            "fingerprint": self.info.fingerprint,
        }

    @staticmethod
    def sampler_counters(state: dict[str, Any]) -> dict[str, int]:
        """What this rank's batchers dropped, cut, repeated or took off their turn so far, summed over its
        loader workers, from a `state_dict` (the counters travel with each part)."""
        total: Counter[str] = Counter()
        for worker in state.get("workers", {}).values():
            total.update(worker.get("batcher", {}).get("counters", {}))
        return dict(sorted(total.items()))

    def state_dict(self) -> dict[str, Any]:
        """Small, picklable: the step count plus each worker's stream position, sampler RNG and buffer
        refs after its part of the last returned batch."""
        return {
            "version": STATE_VERSION,
            "step": self.step,
            "signature": self._signature(),
            "workers": {str(w): s for w, s in self._worker_states.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` left off; the layout (ranks, workers, batch, sampler, data) must match."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')} != {STATE_VERSION}")
        mine, theirs = self._signature(), state["signature"]
        changed = {k: (theirs.get(k), v) for k, v in mine.items() if theirs.get(k) != v}
        if changed:
            raise ValueError(f"loader state does not match this loader (saved, now): {changed}")
        self.close()
        self.step = int(state["step"])
        self._worker_states = {int(w): s for w, s in state["workers"].items()}

    def close(self) -> None:
        """Stop the worker processes (the next batch starts new ones from the current state); batches
        prefetched or joined ahead are dropped."""
        if self._joiner is not None:
            self._joiner.close()
        if self._dropped is not None:
            self._dropped.detach()  # else it would keep the closed thread's queue (a batch) alive
        self._source = self._joiner = self._dropped = None


class EvalStream(IterableDataset):
    def __init__(
        self,
        urls: list[tuple[int, str, ShardInfo, int]],
        batch_size: int,
        transform: Transform,
        with_shards: bool = False,
    ) -> None:
        """`urls`: (shard index, url, what dataset.json lists for it, samples to read: its first ones) of
        each shard this rank reads."""
        super().__init__()
        self.urls, self.batch_size, self.transform = urls, batch_size, transform
        self.with_shards = with_shards

    def _emit(self, batch: list[Sample]) -> tuple[Any, ...]:
        out = (*collate(batch, self.transform), [s.key for s in batch])
        return (*out, [s.shard for s in batch]) if self.with_shards else out

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        batch: list[Sample] = []
        for shard, url, listed, take in self.urls[worker::workers]:
            samples = read_shard(
                url, shard=shard, expected=listed.num_samples, class_counts=listed.class_counts
            )
            # A shard read whole is read to its end: its count checks run there (a shard holding more
            # samples than listed lost the rest silently).
            for sample in samples if take == listed.num_samples else itertools.islice(samples, take):
                batch.append(sample)
                if len(batch) == self.batch_size:
                    yield self._emit(batch)
                    batch = []
        if batch:
            yield self._emit(batch)


class EvalLoader:
    """Batches `(images, labels, categories, sample_keys)` of one split with the test transform; shard i
    goes to rank i mod world, so the union over ranks is the split exactly once. `rank_counts` gives
    every rank's number of samples (from dataset.json) for padding an all-gather. With `with_shards`
    each batch also carries the shard index of every sample (an index's id map needs it). `max_images`
    caps what each rank reads to the first images of its shards in shard order, so a capped evaluation
    sees the same images whatever the number of loader workers (which interleave their batches)."""

    def __init__(
        self,
        root: str | Path,
        split: str,
        batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        transform: Transform | None = None,
        image_size: int = 224,
        resize: int | None = None,
        resize_mode: ResizeMode = "shorter_side",
        info: DatasetInfo | None = None,
        with_shards: bool = False,
        max_images: int | None = None,
    ) -> None:
        self.root = str(root)
        self.info = info or load_dataset_info(root)
        self.split = split
        self.with_shards = with_shards
        self.rank, self.world_size = resolve_rank(rank, world_size)
        shards = self.info.split(split).shards
        urls = self.info.shard_urls(self.root, split)
        self.shards = rank_shards(len(shards), self.rank, self.world_size)
        self.rank_counts = [
            sum(shards[i].num_samples for i in rank_shards(len(shards), r, self.world_size))
            for r in range(self.world_size)
        ]
        if max_images is not None:
            if max_images < 0:
                raise ValueError(f"max_images must be >= 0, got {max_images}")
            self.rank_counts = [min(count, max_images) for count in self.rank_counts]
        self.num_samples = self.rank_counts[self.rank]
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.transform = transform or test_transform(image_size, resize, resize_mode)
        self.image_size = output_side(self.transform, image_size)
        self._urls = []
        left = self.num_samples
        for i in self.shards:
            if left == 0:
                break
            take = min(shards[i].num_samples, left)
            self._urls.append((i, urls[i], shards[i], take))
            left -= take

    def __len__(self) -> int:
        """Upper bound on batches (exact with 0 or 1 loader workers)."""
        return math.ceil(self.num_samples / self.batch_size) + max(0, self.num_workers - 1)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[str]]]:
        if not self._urls:
            return
        workers = min(self.num_workers, len(self._urls))
        dataset = EvalStream(self._urls, self.batch_size, self.transform, self.with_shards)
        need = functools.partial(eval_loader_bytes, self.batch_size, workers, self.image_size)
        with shared_memory_explained(need, f"this rank's {self.split} loader"):
            yield from DataLoader(dataset, batch_size=None, num_workers=workers, collate_fn=_as_is)
