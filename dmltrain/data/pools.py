"""Process pools for one-off data work in Python that one core would do slowly (rendering, shard writing)."""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor


def available_cpus(limit: int = 8) -> int:
    """The CPUs this process may use, at most ``limit`` (a default for one-off work before training): its
    affinity, and a container's CPU quota (a Kubernetes CPU limit), which os.cpu_count() does not see (a
    4-CPU pod on a 64-core node started 32 threads in each of two search servers)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(limit, cpus, quota if quota is not None else cpus))


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """This container's CPU limit, rounded up (cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``), or None."""
    try:
        with open(f"{root}/cpu.max") as handle:
            quota, period = handle.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(f"{root}/cpu/cpu.cfs_quota_us") as q, open(f"{root}/cpu/cpu.cfs_period_us") as p:
                quota, period = q.read().strip(), p.read().strip()
        except OSError:
            return None
    if quota in ("max", "-1") or not quota.lstrip("-").isdigit() or not period.isdigit() or int(period) <= 0:
        return None
    return max(1, math.ceil(int(quota) / int(period)))


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
