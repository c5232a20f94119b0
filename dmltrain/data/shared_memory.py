"""How much shared memory (/dev/shm) a rank's loaders hold, and the one error when a node lacks it.

Why: the training loader's worker processes keep `prefetch_factor` + 1 steps of their parts in shared
buffers (`dmltrain.data.slots`) - at 224 px about 1.85 GB a rank for a local batch of 4,096 - and each
evaluation batch crosses as fresh shared memory too. A container's /dev/shm holds 64 MiB unless it is given
more (`docker run --shm-size`, a Kubernetes emptyDir of medium Memory), and torch then fails inside a
loader worker with "unable to allocate shared memory(shm) ... No space left on device", a RuntimeError a
Ray Train run would retry to no end. The estimate lets a run be refused before it starts; the error turns
the failure that gets through (another process filled /dev/shm) into one line that says what to change.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Literal

from dmltrain.data.errors import SharedMemoryError
from dmltrain.data.metadata import DatasetInfo

SHM_DIR = "/dev/shm"  # where torch's shared tensors live on Linux (shm_open)

# What to do about it, in every message.
SHM_HINT = (
    "give it more (docker run --shm-size=16g or --ipc=host; Kubernetes: an emptyDir of medium Memory on "
    "/dev/shm, as cluster/kubernetes/raycluster.yaml) or lower the batch a rank"
)

# Beside each image a part carries its label and category (int64 each); an encoded part also its size,
# crop parameters (7 x int64) and shard.
_LABEL_BYTES = 16
_ENCODED_EXTRA_BYTES = 16 + 8 + 7 * 8 + 8

# What torch and the DataLoader say when a worker cannot get shared memory: posix_fallocate refused
# ("unable to allocate shared memory(shm) for file ...: No space left on device", the usual case) or, where
# pages were not reserved up front, a worker killed by SIGBUS ("... are out of shared memory").
_EXHAUSTED = ("unable to allocate shared memory", "out of shared memory")


def train_loader_bytes(
    batch_size: int,
    loader_workers: int,
    image_size: int,
    *,
    decode: Literal["cpu", "gpu"] = "cpu",
    host_decode_share: float = 0.0,
    encoded_bytes_per_image: float = 0.0,
    prefetch_factor: int = 2,
) -> int:
    """Shared memory a `TrainLoader` of one rank holds once running: every worker's buffers for
    `prefetch_factor` + 1 steps, which together hold that many local batches (the parts of a step add up to
    `batch_size`). Decoded on the CPU a batch is its uint8 images; decoded on the device it is the JPEG
    bytes plus the `host_decode_share` of images the workers decode. 0 with no worker processes."""
    if loader_workers == 0:
        return 0
    if decode == "gpu":
        per_image = (1 - host_decode_share) * encoded_bytes_per_image + host_decode_share * 3 * image_size**2
        per_image += _ENCODED_EXTRA_BYTES
    else:
        per_image = _decoded_bytes(image_size)
    return int((prefetch_factor + 1) * batch_size * per_image)


def _decoded_bytes(image_size: int) -> int:
    """A decoded part's bytes an image: its uint8 pixels, label and category."""
    return 3 * image_size * image_size + _LABEL_BYTES


def encoded_bytes_per_image(info: DatasetInfo, split: str) -> float:
    """The mean bytes an image of `split` takes in its tar shards (tar headers included): what an encoded
    part ships for it. 0 where the shards were prepared before their sizes were kept."""
    shards = info.split(split).shards
    if not shards or any(shard.size_bytes is None for shard in shards):
        return 0.0
    return sum(shard.size_bytes or 0 for shard in shards) / max(1, sum(s.num_samples for s in shards))


def eval_loader_bytes(batch_size: int, loader_workers: int, image_size: int, prefetch_factor: int = 2) -> int:
    """Shared memory an `EvalLoader` holds while it runs: each worker's `prefetch_factor` batches in flight
    and the one being read."""
    if loader_workers == 0:
        return 0
    return (loader_workers * prefetch_factor + 1) * batch_size * _decoded_bytes(image_size)


def shared_memory_size(path: str = SHM_DIR) -> tuple[int, int] | None:
    """(capacity, free) of the shared-memory file system in bytes, or None where there is none or it has no
    limit: a tmpfs mounted with ``size=0`` reports 0 blocks, and was read as holding nothing (every run with
    loader workers refused)."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    if stats.f_blocks == 0:
        return None
    return stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize


def amount(n: float) -> str:
    """Bytes as a short figure for a message: MiB below a GiB, else GiB with one decimal."""
    return f"{n / 2**20:.0f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def shared_memory_problem(need: int, what: str, path: str = SHM_DIR) -> str | None:
    """Why `need` bytes of shared memory will not fit on this node (`what` says who needs them), else
    None. Compared with the file system's capacity, not its free space: the ranks of one node check while
    their neighbours may already be filling it, and a full /dev/shm at run time is caught as it happens
    (`explain_shared_memory_error`)."""
    size = shared_memory_size(path)
    if size is None or need <= size[0]:
        return None
    return (
        f"{what} would keep about {amount(need)} in shared memory, but {path} holds {amount(size[0])} on "
        f"this node: {SHM_HINT}"
    )


def explain_shared_memory_error(exc: BaseException, need: int, what: str) -> SharedMemoryError | None:
    """A one-line `SharedMemoryError` for a loader failure that is shared memory running out (`need`:
    what this rank's loaders hold, `what` names them), else None."""
    if not any(marker in str(exc) for marker in _EXHAUSTED):
        return None
    size = shared_memory_size()
    held = f"{SHM_DIR} holds {amount(size[0])}, {amount(size[1])} free now" if size else SHM_DIR
    return SharedMemoryError(
        f"a loader worker ran out of shared memory ({held}), where {what} keeps about {amount(need)}: "
        f"{SHM_HINT}"
    )


@contextlib.contextmanager
def shared_memory_explained(need: Callable[[], int], what: str) -> Iterator[None]:
    """Around a loader's reads: a failure for want of shared memory leaves as `explain_shared_memory_error`'s
    `SharedMemoryError` (`need` is evaluated only then), any other error as it was."""
    try:
        yield
    except RuntimeError as exc:
        error = explain_shared_memory_error(exc, need(), what)
        if error is None:
            raise
        raise error from exc
