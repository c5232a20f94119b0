"""Benchmark: the quickstart's CPU training step under glibc's malloc defaults and scaling.keep_freed_memory.

    python bench/malloc.py            # 6 rounds of 30 steps per variant
    python bench/malloc.py --quick    # 2 rounds of 8 steps (smoke)

The bare quickstart step of bench/service.py (resnet18 at 32 px, Smooth-AP, fused Adam, global batch 128 of
synthetic uint8 images, 2 torch threads, the workers' OpenMP wait policy) in a fresh process per block,
since glibc reads its malloc settings once, when a process starts: in the main thread and in a thread of
its own (Ray Train runs the training function in one, whose own malloc arena cannot hold blocks beyond its
64 MB heaps), with glibc's defaults and with the settings scaling.keep_freed_memory gives CPU workers.
Variants alternate within each round (the order rotates), so load changes hit all alike. Prints the median
seconds per step, minor page faults per step (pages the kernel had to find and zero because malloc had
handed them back), kernel CPU ms per step (both threads), the process's peak resident memory (what keeping
freed memory costs) and each variant's speed relative to the default in the same kind of thread.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

CONFIG = ROOT / "configs" / "quickstart.yaml"
VARIANTS = [("main", False), ("main", True), ("thread", False), ("thread", True)]


def _child(where: str, steps: int) -> None:
    """One block in this process: warm-up, then ``steps`` timed steps; prints its figures as JSON."""
    result: dict[str, float] = {}

    def block() -> None:
        # Everything torch does happens here: an OpenMP team started by the main thread as well would put
        # 4 threads on GNU OpenMP's books for 2 CPUs, and it then spins 100 times instead of
        # GOMP_SPINCOUNT before sleeping (about 800 sleeps a step instead of 30): a penalty Ray Train's
        # training thread does not pay, as its process's main thread runs no torch.
        import torch
        from service import _bare_step

        from dmltrain.service.config import load_config

        torch.set_num_threads(2)
        config = load_config(CONFIG, [])
        batch, side = config.train.global_batch_size, config.data.image_size
        gen = torch.Generator().manual_seed(0)
        shape = (batch, 3, side, side)
        batches = [
            (torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen), torch.arange(batch) // 4)
            for _ in range(4)
        ]
        step = _bare_step(config, batches, ddp=False, fused=True)
        for i in range(3):
            step(i)
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for i in range(steps):
            step(i)
        seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        result["seconds"] = seconds / steps
        result["faults"] = (after.ru_minflt - before.ru_minflt) / steps
        result["system_ms"] = 1e3 * (after.ru_stime - before.ru_stime) / steps

    if where == "main":
        block()
    else:
        thread = threading.Thread(target=block)
        thread.start()
        thread.join()
    result["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(result))


def _peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM): what keeping freed memory costs."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _run(where: str, kept: bool, steps: int, base_env: dict[str, str]) -> dict[str, float]:
    from dmltrain.service.config import KEEP_FREED_MEMORY_ENV

    env = {**base_env, **(KEEP_FREED_MEMORY_ENV if kept else {})}
    out = subprocess.run(
        [sys.executable, __file__, "--child", where, "--steps", str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 8 steps")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--child", choices=["main", "thread"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    steps = args.steps or (8 if args.quick else 30)
    if args.child:
        _child(args.child, steps)
        return
    rounds = args.rounds or (2 if args.quick else 6)

    from dmltrain.service.config import load_config
    from dmltrain.service.run import OMP_WAIT_KEYS, worker_env_vars

    worker_env = worker_env_vars(load_config(CONFIG, []))
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    base_env.update({k: v for k, v in worker_env.items() if k in OMP_WAIT_KEYS})
    print(
        f"malloc benchmark, {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}, "
        f"{os.cpu_count()} cores; quickstart step, {rounds} rounds of {steps} steps, OpenMP "
        f"{ {k: v for k, v in worker_env.items() if k in OMP_WAIT_KEYS} }"
    )
    results: dict[tuple[str, bool], list[dict[str, float]]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for variant in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            results[variant].append(_run(*variant, steps, base_env))
        latest = [
            f"{w} {'kept' if k else 'default'} {1e3 * v[-1]['seconds']:.0f} ms"
            for (w, k), v in results.items()
        ]
        print(f"round {r + 1}/{rounds}: " + ", ".join(latest), flush=True)

    def med(variant: tuple[str, bool], key: str) -> float:
        return statistics.median(r[key] for r in results[variant])

    print()
    print("| thread | malloc | s/step | faults/step | kernel ms/step | peak RSS MB | vs default |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for where, kept in VARIANTS:
        seconds = med((where, kept), "seconds")
        ratio = med((where, False), "seconds") / seconds
        print(
            f"| {where} | {'keep_freed_memory' if kept else 'glibc defaults'} | {seconds:.3f} "
            f"| {med((where, kept), 'faults'):,.0f} | {med((where, kept), 'system_ms'):.1f} "
            f"| {med((where, kept), 'peak_rss_mb'):,.0f} | {ratio:.2f}x |"
        )
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
