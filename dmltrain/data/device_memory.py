"""A GPU out of memory while preparing data: not the data's fault (`dmltrain.data.errors`), and kept apart
from those errors because it needs torch, which the light parts of `dmltrain.data` do not import."""

from __future__ import annotations

import re

import torch

_OUT_OF_MEMORY = re.compile(r"\b\w+ out of memory\.")  # torch's allocator: "CUDA out of memory. Tried to..."


class DecodeMemoryError(torch.cuda.OutOfMemoryError):
    """The GPU ran out of memory while decoding a batch's JPEGs (data.decode=gpu): the decoder shares the
    GPU with the training step, so the step's memory, not the decode's (`decode_batch` images at a time),
    is what to lower, or the decoding moves to the loader workers. A CUDA out-of-memory error, so code
    that handles those still does."""


def raise_if_out_of_memory(exc: RuntimeError) -> None:
    """Re-raise ``exc`` if the device ran out of memory, as torch's `OutOfMemoryError` even where a C++
    layer turned it into a plain RuntimeError: torchvision's batched GPU JPEG decoder re-raises every error
    as "Error while decoding JPEG images: <torch's message>", and the TorchScript interpreter wraps what fails
    inside it. A fallback that catches RuntimeError (PIL for a refused image, Python for the compiled crop
    loop) must not take a full GPU for the input's fault."""
    if isinstance(exc, torch.OutOfMemoryError):
        raise exc
    found = _OUT_OF_MEMORY.search(str(exc))
    if found:
        raise torch.OutOfMemoryError(str(exc)[found.start() :]) from exc
