"""Benchmark: what joining a step's decoded parts costs a training thread beside it, pinned two ways.

    python bench/join.py            # B=4,096 at 224 px (617 MB a batch) in 10 parts, 5 rounds of 8 s
    python bench/join.py --quick    # B=1,024, 2 rounds of 2 s (smoke)

With data.decode=cpu a CUDA worker's batch must end in page-locked memory for its chunks' copies to be
asynchronous. Joining the loader workers' parts (torch.cat) and then pinning the result copies the batch
twice and allocates and frees a batch-sized buffer every step; `TrainLoader(pin_memory=True)` joins
straight into page-locked memory from torch's caching host allocator, which hands the same blocks back
step after step. This runs a training-like thread (as bench/decode_thread.py) alone and beside a thread
that joins one batch each way every `--period` seconds (default 0.865 s: the engine's step at B=4,096 on
an H100, so one batch a step as in the service), and prints the training rate against alone, and each
joiner's ms a batch. On CUDA the two ways are the real ones (`.pin_memory()` after the cat, and the
loader's `dmltrain.data.device_decode.joined`); on a CPU-only machine page-locked memory does not exist,
so "pinned" is a buffer reused every step, which is what the caching allocator gives back: the host work
is the same. The last two cases have the parts come as the service's do, from `--parts` DataLoader
worker processes (under SCHED_IDLE, stacking precomputed images), read and joined into pinned memory by
the loader's own `_read_step`: what the training process does for data in the service. "fresh shm" is
the loader until 2026-11-27: every part a new shared-memory tensor (a file descriptor through a socket,
unpickling, mapping and faulting in the pages, unmapping them after); "reused slots" is the loader now:
each worker's buffers are mapped once and reused (`dmltrain.data.slots`).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, get_worker_info

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_thread import _training_step, interleaved  # bench/ is the script's directory

import dmltrain.data.loader as loader_module
from dmltrain.data.device_decode import joined
from dmltrain.data.loader import _as_is, _read_step, _Shipped, run_when_idle
from dmltrain.data.slots import SlotReader, WorkerSlots, released_counter


def _joiners(parts: list[torch.Tensor], cuda: bool) -> dict:
    if cuda:
        return {
            "join, then pin": lambda: torch.cat(parts).pin_memory(),
            "join into pinned": lambda: joined(parts, pin=True),
        }
    reused = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
    reused.fill_(0)
    return {
        "join, then pin": lambda: reused.copy_(torch.cat(parts)),
        "join into pinned": lambda: torch.cat(parts, out=reused),
    }


class _WorkerParts(IterableDataset):
    """Each DataLoader worker's part of every step, as `TrainStream` ships it (decoding aside): precomputed
    images stacked into fresh shared memory by `default_collate` (the loader until 2026-11-27), or with a
    `released` counter into the worker's reused shared buffers (`dmltrain.data.slots`, the loader now)."""

    def __init__(self, shares: list[int], size: int, released: torch.Tensor | None) -> None:
        super().__init__()
        self.shares, self.size, self.released = shares, size, released

    def __iter__(self):
        info = get_worker_info()
        worker = info.id if info is not None else 0
        n = self.shares[worker]
        images = list(torch.randint(0, 256, (n, 3, self.size, self.size), dtype=torch.uint8))
        labels = torch.zeros(n, dtype=torch.int64)
        # depth 3, as the loader's: prefetch_factor + 1
        slots = WorkerSlots(3, self.released) if self.released is not None else None
        for step in itertools.count():
            if slots is None:
                part = (default_collate(images), labels.clone(), labels.clone())
            else:
                out = slots.out(step, "images", (n, 3, self.size, self.size), torch.uint8)
                part = _Shipped.of((torch.stack(images, out=out), labels, labels), slots, step)
            yield part, [], worker, step, {"step": step + 1}


def _received(parts: list[torch.Tensor], reused_slots: bool):
    """A read of the next step's parts from DataLoader worker processes as the loader's join thread does
    it (`_read_step`: received, joined into pinned memory), and the DataLoader."""
    shares = [len(p) for p in parts]
    released = released_counter(0) if reused_slots else None
    with warnings.catch_warnings():  # more worker processes than cores, on purpose: as in the service
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        loader = DataLoader(
            _WorkerParts(shares, parts[0].shape[-1], released),
            batch_size=None,
            num_workers=len(parts),
            collate_fn=_as_is,
            prefetch_factor=2,
            worker_init_fn=run_when_idle,
            persistent_workers=False,
        )
        iterator, steps = iter(loader), itertools.count()
    slots = SlotReader(released) if released is not None else None
    return (lambda: _read_step(iterator, len(parts), steps, True, slots)), loader


def _pinned_as_reused_buffers() -> None:
    """Without CUDA: the loader's joins into pinned memory write into buffers reused step after step
    instead, which is what torch's caching host allocator hands back on CUDA (the same host work)."""
    buffers: dict[tuple, torch.Tensor] = {}

    def join(pieces, pin: bool = False, copy: bool = False) -> torch.Tensor:
        shape = (sum(len(p) for p in pieces), *pieces[0].shape[1:])
        key = (shape, pieces[0].dtype)
        if key not in buffers:
            buffers[key] = torch.zeros(shape, dtype=pieces[0].dtype)
        return torch.cat(list(pieces), out=buffers[key])

    loader_module.joined = join


def _run_case(step, join, seconds: float, period: float) -> tuple[float, float]:
    """Training steps/s, and ms a batch of the joining thread beside it (0 without one)."""
    stop, joined, busy = threading.Event(), [0], [0.0]

    def join_forever() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            batch = join()
            del batch
            took = time.perf_counter() - started
            busy[0] += took
            joined[0] += 1
            stop.wait(max(0.0, period - took))

    thread = threading.Thread(target=join_forever, daemon=True) if join else None
    if thread:
        thread.start()
        time.sleep(0.2)
    steps, start, done, spent = 0, time.perf_counter(), joined[0], busy[0]
    while time.perf_counter() - start < seconds:
        step()
        steps += 1
    elapsed = time.perf_counter() - start
    batches, spent = joined[0] - done, busy[0] - spent
    stop.set()
    if thread:
        thread.join()
    return steps / elapsed, (spent / batches * 1e3 if batches else 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="B=1,024, 2 rounds of 2 s")
    parser.add_argument("--batch", type=int, help="images a batch (default 4,096; --quick 1,024)")
    parser.add_argument("--parts", type=int, default=10, help="loader workers' parts a batch")
    parser.add_argument("--size", type=int, default=224, help="crop side in pixels")
    parser.add_argument("--period", type=float, default=0.865, help="seconds between batches (one a step)")
    args = parser.parse_args()
    rounds, seconds = (2, 2.0) if args.quick else (5, 8.0)
    batch = args.batch or (1024 if args.quick else 4096)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)  # one core each for the two threads, as a GPU process's host threads
    step = _training_step(device)
    share = -(-batch // args.parts)
    parts = [
        torch.randint(0, 256, (min(share, batch - i * share), 3, args.size, args.size), dtype=torch.uint8)
        for i in range(args.parts)
    ]
    if not cuda:
        _pinned_as_reused_buffers()
    fresh, _ = _received(parts, reused_slots=False)
    reused, _ = _received(parts, reused_slots=True)
    cases = {
        "training alone": None,
        **_joiners(parts, cuda),
        "received, fresh shm": fresh,
        "received, reused slots": reused,
    }
    # the warm-up fills the caching host allocator and faults the first pages in
    results = interleaved(cases, step, 2, rounds, lambda join: _run_case(step, join, seconds, args.period))
    megabytes = sum(p.numel() for p in parts) / 1e6
    print(
        f"device {device}, torch {torch.__version__}, B={batch} at {args.size} px in {args.parts} parts "
        f"({megabytes:.0f} MB a batch) one every {args.period} s, {rounds} rounds of {seconds:.0f} s (median)"
        + ("" if cuda else "; no CUDA: 'pinned' is a reused buffer")
    )
    alone = statistics.median(r[0] for r in results["training alone"])
    print(f"{'case':<26}{'train steps/s':>15}{'vs alone':>10}{'ms a batch':>12}")
    for name, rows in results.items():
        rate = statistics.median(r[0] for r in rows)
        ms = statistics.median(r[1] for r in rows)
        print(f"{name:<26}{rate:>15.1f}{rate / alone:>9.2f}x{(f'{ms:.0f}' if ms else '-'):>12}")


if __name__ == "__main__":
    main()
