"""The next batch, fetched and pinned in a background thread while the current step computes.

From pinned (page-locked) host memory the engine's per-chunk host->device copies are asynchronous, so the
host keeps queueing GPU work instead of waiting for each copy; pinning a batch is itself a host copy, so it
happens here, overlapped with the step. The loader's state is captured right after each batch is drawn and
travels with it: a checkpoint after step n still resumes at batch n + 1, although batch n + 1 has already
been drawn.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Protocol

import torch


class _BatchSource(Protocol):
    def next_batch(self) -> tuple[Any, ...]: ...

    def state_dict(self) -> dict[str, Any]: ...


def _pinned(item: Any) -> Any:
    """A host tensor in page-locked memory; anything else (a batch already on the GPU) as it is."""
    return item.pin_memory() if isinstance(item, torch.Tensor) and item.device.type == "cpu" else item


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class BatchPrefetcher:
    """`next_batch()` and `state_dict()` of a loader, one batch ahead, tensors pinned when ``pin``."""

    def __init__(self, source: _BatchSource, *, pin: bool, depth: int = 1) -> None:
        self.source = source
        self.pin = pin
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: dict[str, Any] | None = None

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.source.next_batch()
                state = self.source.state_dict()
                if self.pin:
                    batch = tuple(_pinned(t) for t in batch)
                while not self._stop.is_set():
                    try:
                        self._queue.put((batch, state), timeout=0.5)
                        break
                    except queue.Full:
                        continue
        except BaseException as error:  # surfaces in the training thread, with its own message
            if not self._stop.is_set():
                self._queue.put(_Failure(error))

    def next_batch(self) -> tuple[Any, ...]:
        """The next batch (blocks while it is being read); re-raises a failure of the reading thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="dmltrain-prefetch", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if isinstance(item, _Failure):
            raise item.error
        batch, self._state = item
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The loader's state right after the last batch `next_batch` returned."""
        if self._state is None:
            return self.source.state_dict()  # nothing drawn yet: the loader is where it was left
        return self._state

    def close(self) -> None:
        """Stop the thread (the batch it may hold is dropped; the loader state returned stays valid)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
