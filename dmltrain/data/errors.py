"""Errors the data itself causes. They fail the same way on every attempt (a restart replays the same
samples), so the service ends a run on them instead of retrying (`dmltrain.service.errors`)."""

from __future__ import annotations


class SampleError(ValueError):
    """A sample cannot become a training image: undecodable bytes, or a transform whose output sizes
    differ. The message names the sample and its shard."""


class SamplingError(RuntimeError):
    """A consumer's part of a batch cannot be drawn from the classes its shards hold."""
