"""Loader workers hand their parts over through reused shared buffers (`dmltrain.data.slots`).

Unit checks of the buffer protocol (a buffer crosses once, then only references; growth; a worker waits
before overwriting what the reader has not released), and the loader's guarantees with real worker
processes: batches a caller holds stay intact while later steps reuse the buffers, with one worker (a
single part, still copied) and with several, decoding on the CPU and on the device path.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from test_device_decode import build, loader

from dmltrain.data.slots import SlotReader, WorkerSlots, released_counter


def test_a_buffer_crosses_once_then_only_references() -> None:
    released = released_counter(0)
    worker, reader = WorkerSlots(2, released), SlotReader(released)
    seen = []
    for step in range(6):
        images = worker.out(step, "images", (3, 4), torch.uint8)
        images.fill_(step)
        refs = worker.ship(step, {"images": images, "labels": torch.arange(3) + step})
        seen.append({f: r.buffer is not None for f, r in refs.items()})
        views = reader.tensors(0, refs)
        assert torch.equal(views["images"], torch.full((3, 4), step, dtype=torch.uint8))
        assert torch.equal(views["labels"], torch.arange(3) + step)
        reader.release(step)
    # two slots per field: each buffer is sent with the first step that uses it, never again
    assert seen == [{"images": True, "labels": True}] * 2 + [{"images": False, "labels": False}] * 4


def test_a_larger_part_grows_its_slot_and_sends_it_again() -> None:
    released = released_counter(0)
    worker, reader = WorkerSlots(1, released), SlotReader(released)
    # 100; 90 fits; 110 grows it to 125 (a quarter of headroom), so 120 fits; 200 grows it again
    for step, (n, sent) in enumerate([(100, True), (90, False), (110, True), (120, False), (200, True)]):
        refs = worker.ship(step, {"labels": torch.arange(n)})
        assert (refs["labels"].buffer is not None) == sent, (step, n)
        assert torch.equal(reader.tensors(0, refs)["labels"], torch.arange(n))
        reader.release(step)


def test_a_worker_waits_until_the_step_that_used_its_slot_is_released() -> None:
    released = released_counter(0)
    worker = WorkerSlots(2, released)
    worker.out(0, "images", (2,), torch.uint8)
    worker.out(1, "images", (2,), torch.uint8)
    wrote = threading.Event()

    def write_step_2() -> None:  # slot 0 again: step 0 must be released first
        worker.out(2, "images", (2,), torch.uint8)
        wrote.set()

    thread = threading.Thread(target=write_step_2, daemon=True)
    thread.start()
    time.sleep(0.2)
    assert not wrote.is_set()
    SlotReader(released).release(0)
    assert wrote.wait(5)
    thread.join()
    with pytest.raises(ValueError, match="depth must be >= 1"):
        WorkerSlots(0, released)


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("slots"), 16, 6, ("jpeg",))


@pytest.mark.parametrize(("decode", "workers"), [("cpu", 1), ("cpu", 2), ("gpu", 1), ("gpu", 2)])
def test_batches_held_by_the_caller_survive_later_steps(jpegs: Path, decode: str, workers: int) -> None:
    """The loader copies every part out of the workers' buffers before releasing them (a single part too),
    so a batch stays as it was returned while the workers write ten more steps into the same buffers."""
    source = loader(jpegs, decode, workers, host_decode_share=0.5 if decode == "gpu" else 0.0)
    try:
        first = source.next_batch()
        kept = [t.clone() for t in first[:3]]
        later = [source.next_batch() for _ in range(10)]
    finally:
        source.close()
    for held, copy in zip(first[:3], kept, strict=True):
        assert torch.equal(held, copy)
    assert not any(torch.equal(first[0], batch[0]) for batch in later)  # the steps did differ
