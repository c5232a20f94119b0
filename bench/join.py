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
joiner's ms a batch. On CUDA the two ways are the real ones (`.pin_memory()` after the cat, and the loader's
`_joined`); on a CPU-only machine page-locked memory does not exist, so "pinned" is a buffer reused every
step, which is what the caching allocator gives back: the host work is the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_thread import _training_step, interleaved  # bench/ is the script's directory

from dmltrain.data.loader import _joined


def _joiners(parts: list[torch.Tensor], cuda: bool) -> dict:
    if cuda:
        return {
            "join, then pin": lambda: torch.cat(parts).pin_memory(),
            "join into pinned": lambda: _joined(parts, pin=True),
        }
    reused = torch.empty((sum(len(p) for p in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
    reused.fill_(0)
    return {
        "join, then pin": lambda: reused.copy_(torch.cat(parts)),
        "join into pinned": lambda: torch.cat(parts, out=reused),
    }


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
    cases = {"training alone": None, **_joiners(parts, cuda)}
    # the warm-up fills the caching host allocator and faults the first pages in
    results = interleaved(cases, step, 2, rounds, lambda join: _run_case(step, join, seconds, args.period))
    megabytes = sum(p.numel() for p in parts) / 1e6
    print(
        f"device {device}, torch {torch.__version__}, B={batch} at {args.size} px in {args.parts} parts "
        f"({megabytes:.0f} MB a batch) one every {args.period} s, {rounds} rounds of {seconds:.0f} s (median)"
        + ("" if cuda else "; no CUDA: 'pinned' is a reused buffer")
    )
    alone = statistics.median(r[0] for r in results["training alone"])
    print(f"{'case':<24}{'train steps/s':>15}{'vs alone':>10}{'ms a batch':>12}")
    for name, rows in results.items():
        rate = statistics.median(r[0] for r in rows)
        ms = statistics.median(r[1] for r in rows)
        print(f"{name:<24}{rate:>15.1f}{rate / alone:>9.2f}x{(f'{ms:.0f}' if ms else '-'):>12}")


if __name__ == "__main__":
    main()
