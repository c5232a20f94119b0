"""Shared-memory slots that loader worker processes reuse step after step to hand batches over.

A DataLoader worker normally returns each part of a batch as a fresh shared-memory tensor: the worker
allocates and fills new pages, the training process receives a file descriptor through a socket, maps the
pages, faults every one in while it reads them, and unmaps them again afterwards, all for the next step's
hundreds of megabytes, in the process whose main thread drives the training step. Measured with `python
bench/join.py` (B=4,096 at 224 px from 10 worker processes, 2-core machine): a training-like thread beside
the reads of parts received that way kept 0.70-0.83x of its speed, 0.91-1.03x with these buffers, and
0.92-0.96x beside the join alone. Here each worker keeps `depth` buffers per field in shared memory and
writes step s's part into buffer s % depth; the training process maps a buffer once, when it first
arrives, and afterwards receives only a `SlotRef` naming it. A shared counter says which steps the
training process has finished reading, and a worker waits before it overwrites a buffer the training
process may still read.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

# A slot grows to the largest part seen, with headroom, so that parts of varying size do not reallocate.
_GROWTH = 1.25


@dataclass
class SlotRef:
    """What crosses the DataLoader's queue instead of a tensor: the worker's buffer for `field` at `slot`,
    of which the first elements hold a tensor of `shape`. `buffer` is the shared buffer itself, sent only
    when the worker allocated it (the first time, or grown); otherwise the reader has it already."""

    field: str
    slot: int
    shape: tuple[int, ...]
    buffer: torch.Tensor | None = None


class WorkerSlots:
    """Worker side: `out(step, field, shape, dtype)` is where to write that step's tensor for `field`, and
    `ship(step, tensors)` turns a part's tensors into `SlotRef`s (copying those not written in place).

    `released` is a one-element shared int64 tensor that the training process sets to the last step it has
    finished reading; a worker about to write step s waits until step s - depth is released, since that
    step used the same buffer. With `depth` above the DataLoader's prefetch depth, it never waits in
    practice (the DataLoader asks a worker for a step only after the training process took an earlier one).
    """

    def __init__(self, depth: int, released: torch.Tensor) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth, self.released = depth, released
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self._written: dict[str, tuple[torch.Tensor, SlotRef]] = {}

    def out(self, step: int, field: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` in the slot of `step` for `field`, to write that field's tensor into."""
        while int(self.released[0]) < step - self.depth:
            time.sleep(0.0005)
        slot = step % self.depth
        numel = math.prod(shape)
        buffer = self._buffers.get((field, slot))
        sent = None
        if buffer is None or buffer.dtype != dtype or buffer.numel() < numel:
            grown = int(buffer.numel() * _GROWTH) if buffer is not None and buffer.dtype == dtype else 0
            buffer = torch.empty(max(numel, grown, 1), dtype=dtype).share_memory_()
            self._buffers[(field, slot)] = sent = buffer
        view = buffer[:numel].view(shape)
        self._written[field] = (view, SlotRef(field, slot, tuple(shape), sent))
        return view

    def ship(self, step: int, tensors: dict[str, torch.Tensor]) -> dict[str, SlotRef]:
        """References for a part's tensors: those written through `out` as they are, the others (small:
        labels, sizes) copied into their slots first."""
        refs = {}
        for field, tensor in tensors.items():
            written = self._written.pop(field, None)
            if written is None or written[0] is not tensor:
                self.out(step, field, tuple(tensor.shape), tensor.dtype).copy_(tensor)
                written = self._written.pop(field)
            refs[field] = written[1]
        self._written.clear()
        return refs


class SlotReader:
    """Training-process side: the tensors that `SlotRef`s stand for, as views of buffers mapped once.

    A view is valid until `release(step)` is called for its step: the worker may then overwrite it, so a
    caller copies (joins) what it keeps before releasing."""

    def __init__(self, released: torch.Tensor) -> None:
        self.released = released
        self._buffers: dict[tuple[int, str, int], torch.Tensor] = {}

    def tensors(self, worker: int, refs: dict[str, SlotRef]) -> dict[str, torch.Tensor]:
        out = {}
        for field, ref in refs.items():
            key = (worker, ref.field, ref.slot)
            if ref.buffer is not None:
                self._buffers[key] = ref.buffer
            out[field] = self._buffers[key][: math.prod(ref.shape)].view(ref.shape)
        return out

    def release(self, step: int) -> None:
        """Every tensor of steps up to `step` has been read: the workers may reuse their buffers."""
        self.released[0] = step


def released_counter(first_step: int) -> torch.Tensor:
    """The shared counter of a new set of workers that starts at `first_step` (nothing read yet)."""
    return torch.full((1,), first_step - 1, dtype=torch.int64).share_memory_()
