"""Errors the data itself causes. They fail the same way on every attempt (a restart replays the same
samples), so the service ends a run on them instead of retrying (`dmltrain.service.errors`)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dmltrain.data.shards import Sample


_IN_MEMORY_FILE = re.compile(r" <_io\.\w+ object at 0x[0-9a-fA-F]+>")  # PIL names the BytesIO it read


class SampleError(ValueError):
    """A sample cannot become a training image: undecodable bytes, or a transform whose output sizes
    differ. The message names the sample and its shard."""


class SamplingError(RuntimeError):
    """A consumer's part of a batch cannot be drawn from the classes its shards hold."""


class SharedMemoryError(RuntimeError):
    """The loader workers cannot get the shared memory (/dev/shm) their batches cross in: the same on every
    attempt until the node's /dev/shm grows or the batch a rank shrinks (`dmltrain.data.shared_memory`)."""


def sample_name(key: str, url: str) -> str:
    """How messages name a sample, on every decode path."""
    return f"sample {key!r} of shard {url}"


def unusable_sample(sample: Sample, exc: BaseException) -> SampleError:
    """The one error for a sample that cannot become a training image, whether decoding or the transform
    failed, on either decode path (the message names the sample and its shard)."""
    where = sample_name(sample.key, sample.url or str(sample.shard))
    return SampleError(f"{where}: cannot decode/transform the image: {_IN_MEMORY_FILE.sub('', str(exc))}")


def first_few(items: list[str], shown: int, sep: str = ", ") -> str:
    """The first `shown` of `items` joined by `sep`, then how many more: a message stays one line however
    many shards or files are at fault."""
    return sep.join(items[:shown]) + (f" and {len(items) - shown} more" if len(items) > shown else "")


def first_line(exc: BaseException) -> str:
    """An error's first line for a log or message line, or its type where it has no message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def decode_failure(exc: BaseException) -> str:
    """Why image bytes could not be decoded, as ``Type: message``, without the address of the BytesIO
    PIL was given (which made the same bad file read differently on every run)."""
    return f"{type(exc).__name__}: {_IN_MEMORY_FILE.sub('', str(exc))}"
