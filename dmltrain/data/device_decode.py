"""JPEG decoding and augmentation on the training device (nvJPEG through torchvision), for data at GPU rates.

With ``decode="gpu"`` a loader worker only samples, reads the tar shards and draws every image's crop and
flip (`TrainAugment.draw`: the same seeded draws, in the same order, as the CPU path), then ships its part
still encoded (`EncodedPart`: the JPEG bytes back to back in one uint8 tensor, crop boxes, flip flags,
labels). The training process joins the parts of a step and `DeviceDecoder` decodes them on the device in
batched `torchvision.io.decode_jpeg` calls, then crops, resizes and flips them there with
`TrainAugment.apply_batch` (what `TrainAugment.apply` gives on that device, image for image, with less
work per image on the host). Host buffers are pinned and copied without blocking, on a side stream, so the
work overlaps the training step when it runs one step ahead (the loader's join thread).

Per image, what nvJPEG should not see is decoded by PIL in the loader worker with the same parameters:
PNG/WebP samples, greyscale or CMYK JPEGs, JPEGs with an EXIF orientation to apply (`flatten` turns them
upright) and JPEGs that do not end with their end-of-image marker (truncated, or with trailing data: PIL
tells which). A JPEG the device decoder refuses is retried alone, then decoded by PIL in the training
process (logged); an image no decoder can read fails naming its sample and shard. On a CPU device the same
path runs with libjpeg (tests, comparisons).
"""

from __future__ import annotations

import dataclasses
import functools
import io
import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info
from torchvision.io import ImageReadMode, decode_jpeg

from dmltrain.data.device_memory import raise_if_out_of_memory
from dmltrain.data.errors import SampleError, first_line, sample_name, unusable_sample
from dmltrain.data.shards import Sample
from dmltrain.data.transforms import CropFlip, TrainAugment, decode, exif_orientation

log = logging.getLogger("dmltrain.data.device_decode")

DecodeMode = Literal["auto", "cpu", "gpu"]
DECODE_MODES: tuple[str, ...] = ("auto", "cpu", "gpu")

# torchvision 0.29 deprecates its image decoders in favour of TorchCodec (same nvJPEG underneath); the
# GPU image's torchvision 0.26 does not. One narrow filter, so a batch decode does not warn every step.
warnings.filterwarnings("ignore", message=r"(?s).*image decoding and encoding capabilities of TorchVision")

# Where a loader worker writes a part's tensor: (field, shape, dtype) -> a tensor of that shape to fill (a
# reused shared buffer, `dmltrain.data.slots`).
OutBuffer = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]

# Columns of EncodedPart.params.
_FLIP, _IMAGE_HEIGHT, _IMAGE_WIDTH = 4, 5, 6  # after the crop box (top, left, height, width)


@dataclass
class EncodedPart:
    """A loader worker's part of a batch in GPU-decode mode: n images, of which the ones with
    ``sizes[i] > 0`` are still encoded (their bytes in order in ``data``) and the others were decoded and
    augmented by the worker (in order in ``decoded``)."""

    data: torch.Tensor  # uint8 (total bytes,)
    sizes: torch.Tensor  # int64 (n,): encoded bytes of image i; 0 = in `decoded`
    params: torch.Tensor  # int64 (n, 7): crop top, left, height, width, flip, image height, image width
    decoded: torch.Tensor  # uint8 (m, 3, S, S)
    labels: torch.Tensor  # int64 (n,)
    categories: torch.Tensor  # int64 (n,)
    shards: torch.Tensor  # int64 (n,): shard index of image i (for messages)

    def __len__(self) -> int:
        return len(self.labels)

    @staticmethod
    def join(parts: Sequence[EncodedPart], pin: bool = False, copy: bool = False) -> EncodedPart:
        """The parts of one step as one part, in order (what the loader's join thread does). With `pin`,
        the bytes and the decoded images are joined straight into page-locked memory, which the device
        decoder then copies without blocking and without pinning a second copy. `copy`: a single part
        is copied too (its tensors are views of buffers its worker will reuse)."""
        if len(parts) == 1 and not copy:
            return parts[0]
        pinned = ("data", "decoded") if pin else ()
        return EncodedPart(
            **{f: joined([getattr(p, f) for p in parts], f in pinned, copy) for f in encoded_fields()}
        )


def encoded_fields() -> tuple[str, ...]:
    """The tensor fields of an `EncodedPart`, in order: what a join concatenates and a worker ships."""
    return tuple(f.name for f in dataclasses.fields(EncodedPart))


def joined(pieces: Sequence[torch.Tensor], pin: bool = False, copy: bool = False) -> torch.Tensor:
    """`pieces` concatenated; with `pin` into page-locked memory from torch's caching host allocator.
    Why: a CUDA copy is asynchronous only from pinned memory, and pinning a joined batch afterwards costs
    a second copy plus a fresh allocation and release of the whole batch every step (`python
    bench/join.py`: at B=4,096 and 224 px, 617 MB, 420 ms of a core against 64). `copy`: a new tensor
    even for one piece."""
    if not pin:
        return pieces[0] if len(pieces) == 1 and not copy else torch.cat(list(pieces))
    first = pieces[0]
    out = torch.empty((sum(len(p) for p in pieces), *first.shape[1:]), dtype=first.dtype, pin_memory=True)
    return torch.cat(list(pieces), out=out)


def _empty(field: str, shape: tuple[int, ...], dtype: torch.dtype, out: OutBuffer | None) -> torch.Tensor:
    """A tensor that a loader worker hands over without a copy: `out`'s buffer for `field`, else fresh
    shared memory (as default_collate does)."""
    if out is not None:
        return out(field, shape, dtype)
    tensor = torch.empty(shape, dtype=dtype)
    return tensor.share_memory_() if get_worker_info() is not None else tensor


def _header(data: bytes) -> tuple[str | None, str, int, int, int]:
    """(format, mode, height, width, EXIF orientation) from the image header alone (PIL does not decode
    pixels here; a JPEG's EXIF comes before them)."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
        return image.format, image.mode, height, width, exif_orientation(image)


def for_the_device(data: bytes, fmt: str | None, mode: str, orientation: int = 1) -> bool:
    """An upright colour JPEG that ends with its end-of-image marker: what the device decoder gets."""
    return fmt == "JPEG" and mode == "RGB" and orientation == 1 and data.rstrip(b"\0").endswith(b"\xff\xd9")


def on_the_host(position: int, host_share: float) -> bool:
    """Whether the image at `position` of a part is one of the `host_share` of a part's images that the
    loader worker decodes itself (spread evenly over the part, the same positions at every step)."""
    return int((position + 1) * host_share) > int(position * host_share)


def encode_part(
    samples: list[Sample], augment: TrainAugment, host_share: float = 0.0, out: OutBuffer | None = None
) -> EncodedPart:
    """Runs in a loader worker: the crop/flip draws of every image (in batch order, so they equal the CPU
    path's), the encoded bytes of those the device decodes, and PIL decodes of the rest.

    host_share: the fraction of images this worker decodes and augments with PIL even where the device
    could (`on_the_host`). Why: the device path's decodes are driven by one host thread in the training
    process, which sets the pace of a fast GPU's steps, while the loader workers, which only read and draw
    in this mode, have cores to spare; sharing the decodes lets both work. The same draws either way.
    out: where to write the bytes and the decoded images (`OutBuffer`; default fresh shared memory)."""
    if not 0.0 <= host_share <= 1.0:
        raise ValueError(f"host_share must be in [0, 1], got {host_share}")
    params: list[list[int]] = []
    sizes: list[int] = []
    decoded: list[torch.Tensor] = []
    for position, sample in enumerate(samples):
        try:
            fmt, mode, height, width, orientation = _header(sample.data)
            device = for_the_device(sample.data, fmt, mode, orientation)
            device = device and not on_the_host(position, host_share)
            if device:
                box = augment.draw(height, width)
            else:  # drawn on the decoded (upright) size, as the CPU path draws
                image = decode(sample.data)
                height, width = image.shape[-2:]
                box = augment.draw(height, width)
                decoded.append(augment.apply(image, box))
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError...
            raise unusable_sample(sample, exc) from exc
        sizes.append(len(sample.data) if device else 0)
        params.append([box.top, box.left, box.height, box.width, int(box.flip), height, width])
    data = _empty("data", (sum(sizes),), torch.uint8, out)
    flat, offset = data.numpy(), 0
    for sample, size in zip(samples, sizes, strict=True):
        if size:
            flat[offset : offset + size] = np.frombuffer(sample.data, dtype=np.uint8)
            offset += size
    stacked = _empty("decoded", (len(decoded), 3, augment.size, augment.size), torch.uint8, out)
    if decoded:
        torch.stack(decoded, out=stacked)
    return EncodedPart(
        data=data,
        sizes=torch.tensor(sizes, dtype=torch.int64),
        params=torch.tensor(params, dtype=torch.int64).reshape(-1, 7),
        decoded=stacked,
        labels=torch.tensor([s.cls for s in samples], dtype=torch.int64),
        categories=torch.tensor([s.category for s in samples], dtype=torch.int64),
        shards=torch.tensor([s.shard for s in samples], dtype=torch.int64),
    )


class DeviceDecoder:
    """Turns a joined `EncodedPart` into the uint8 (n, 3, S, S) batch on `device`.

    Encoded images are decoded in batches of `decode_batch` (bounding the device memory that full-size
    decoded images take), then cropped/resized/flipped by `augment.apply_batch`. On CUDA the work runs on a
    side stream; the batch is ready when returned, and is recorded on the stream that was current where the
    decoder was made (the training thread's), so the allocator does not reuse it while training reads it.
    """

    def __init__(
        self, augment: TrainAugment, device: torch.device, urls: Sequence[str], decode_batch: int = 512
    ) -> None:
        if decode_batch < 1:
            raise ValueError(f"decode_batch must be >= 1, got {decode_batch}")
        self.augment, self.device, self.urls, self.decode_batch = augment, device, list(urls), decode_batch
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.consumer = torch.cuda.current_stream(device) if self.cuda else None
        self.fallbacks = 0  # images the device decoder refused and PIL decoded (logged one by one)

    def __call__(self, part: EncodedPart, keys: Sequence[str]) -> torch.Tensor:
        if self.stream is None:
            return self._run(part, keys)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            batch = self._run(part, keys)
            batch.record_stream(self.consumer)
        self.stream.synchronize()  # this (loader) thread waits, not the training thread
        return batch

    def _run(self, part: EncodedPart, keys: Sequence[str]) -> torch.Tensor:
        sizes = part.sizes.tolist()
        encoded = [i for i, size in enumerate(sizes) if size]
        ready = [i for i, size in enumerate(sizes) if not size]
        pieces: list[tuple[list[int], torch.Tensor]] = []  # (batch positions, uint8 images there)
        if encoded:
            data = part.data.pin_memory() if self.cuda else part.data
            views = torch.split(data, [sizes[i] for i in encoded])
            params = part.params.tolist()
            for start in range(0, len(encoded), self.decode_batch):
                chunk = encoded[start : start + self.decode_batch]
                decoded = self._decode(list(views[start : start + len(chunk)]), chunk, params, keys, part)
                boxes = [CropFlip(*params[i][:4], bool(params[i][_FLIP])) for i in chunk]
                pieces.append((chunk, self.augment.apply_batch(decoded, boxes)))
        if ready:
            done = part.decoded.pin_memory() if self.cuda else part.decoded
            pieces.append((ready, done.to(self.device, non_blocking=True)))
        if not pieces:
            return torch.empty(
                (0, 3, self.augment.size, self.augment.size), dtype=torch.uint8, device=self.device
            )
        if len(pieces) == 1:
            return pieces[0][1]  # one piece holds every position, in order
        batch = torch.empty((len(part), *pieces[0][1].shape[1:]), dtype=torch.uint8, device=self.device)
        for positions, images in pieces:
            batch.index_copy_(0, torch.tensor(positions, device=self.device), images)
        return batch

    def _decode(
        self,
        views: list[torch.Tensor],
        index: list[int],
        params: list[list[int]],
        keys: Sequence[str],
        part: EncodedPart,
    ) -> list[torch.Tensor]:
        """One batched decode; if it fails (one bad image fails the call) or an image's shape is not the
        header's, the images are decoded one by one, falling back to PIL."""
        try:
            images = decode_jpeg(views, mode=ImageReadMode.RGB, device=self.device)
        except RuntimeError as exc:
            raise_if_out_of_memory(exc)  # not the images' fault: PIL would hide it behind a warning per image
            images = [None] * len(views)
        out = []
        for view, i, image in zip(views, index, images, strict=True):
            shape = (3, params[i][_IMAGE_HEIGHT], params[i][_IMAGE_WIDTH])
            if image is None or tuple(image.shape) != shape:
                image = self._decode_one(view, shape, sample_name(keys[i], self._url(part, i)))
            out.append(image)
        return out

    def _decode_one(self, view: torch.Tensor, shape: tuple[int, ...], where: str) -> torch.Tensor:
        try:
            image = decode_jpeg(view, mode=ImageReadMode.RGB, device=self.device)
            if tuple(image.shape) == shape:
                return image
            why = f"decoded shape {tuple(image.shape)}, header says {shape}"
        except RuntimeError as exc:
            raise_if_out_of_memory(exc)
            why = first_line(exc)
        data = view.numpy().tobytes()
        try:
            image = decode(data)
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError...
            raise SampleError(f"{where}: cannot decode the image: {exc} (device decoder: {why})") from exc
        self.fallbacks += 1
        log.warning("%s: the device decoder failed (%s); decoded by PIL instead", where, why)
        return image.to(self.device)

    def _url(self, part: EncodedPart, i: int) -> str:
        shard = int(part.shards[i])
        return self.urls[shard] if 0 <= shard < len(self.urls) else str(shard)


@functools.cache
def _probe(device: str) -> str | None:
    """None if a tiny JPEG decodes on `device` about as PIL decodes it, else why not."""
    rng = np.random.default_rng(0)
    pixels = np.clip(rng.normal(128, 40, (16, 24, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    data = out.getvalue()
    try:
        image = decode_jpeg(
            torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB, device=device
        )
    except Exception as exc:  # no nvJPEG in this torchvision build, a driver problem...
        return f"{type(exc).__name__}: {exc}"
    error = (image.cpu().float() - decode(data).float()).abs().mean().item()
    return None if error < 8 else f"a test image decodes {error:.1f} grey levels away from PIL's decode"


def device_decode_problem(device: torch.device) -> str | None:
    """Why torchvision cannot decode JPEGs on `device`, or None if it can (checked once per device)."""
    return _probe(str(device))


def resolve_decode(mode: str, device: torch.device | str | None) -> tuple[str, torch.device | None]:
    """``("cpu", None)`` or ``("gpu", device)`` for a `decode` setting.

    auto: the device path when `device` (default: the current CUDA device, if any) is CUDA and decodes a
    test JPEG, else the CPU path. gpu: the device path, an error if it cannot run; an explicit CPU `device`
    runs the same path with libjpeg (tests, comparisons). cpu: PIL in the loader workers.
    """
    if mode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {DECODE_MODES}, got {mode!r}")
    if mode == "cpu":
        return "cpu", None
    if device is not None:
        target: torch.device | None = torch.device(device)
    else:
        target = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if mode == "auto":
        if target is not None and target.type == "cuda" and device_decode_problem(target) is None:
            return "gpu", target
        return "cpu", None
    if target is None:
        raise ValueError("decode='gpu' needs a CUDA device, and none is visible (use decode='auto' or 'cpu')")
    if target.type == "cuda":
        problem = device_decode_problem(target)
        if problem is not None:
            raise ValueError(f"decode='gpu': torchvision cannot decode JPEGs on {target}: {problem}")
    return "gpu", target
