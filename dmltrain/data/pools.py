"""Process pools for one-off data work in Python that one core would do slowly (rendering, shard writing)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor


def available_cpus(limit: int = 8) -> int:
    """The CPUs this process may run on, at most ``limit`` (a default for one-off work before training)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(limit, cpus))


@contextlib.contextmanager
def process_pool(workers: int) -> Iterator[ProcessPoolExecutor | None]:
    """A pool of ``workers`` processes, or None (the caller runs inline) for one.

    On Linux the workers are forked: a spawned one imports dmltrain.data, and with it torch (about 5 s
    on a 2-core machine), before its first task, which costs more than the work it takes over. Tasks not
    started when the caller leaves the block early are cancelled, not run.
    """
    if workers <= 1:
        yield None
        return
    context = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=context)
    try:
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
