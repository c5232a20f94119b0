"""How much memory a loss call may use, from the device it runs on.

Two budgets: the working memory of one block of query rows (its temporaries), and the most the loss may
keep between forward and backward (the ``rows x columns`` Jacobian of `_rowwise`). On CPU the block budget
is the measured sweet spot of 64 MB (cache-sized blocks, see `_rowwise`); on CUDA small blocks only add
kernel launches, so the block grows with the memory the device has free, up to a cap beyond which nothing
got faster on an H100 (B=16,384: 64 MB blocks 0.38-0.66 s, 2 GB blocks 0.045-0.055 s). When the Jacobian
would exceed the saved budget the loss streams column tiles instead (`_streamed`).
"""

from __future__ import annotations

import os

import torch

# CPU block budget (and the block budget of any device without a memory query).
DEFAULT_MEMORY_BUDGET_MB = 64.0
# CUDA: a block may take this share of the memory the allocator can still hand out, within these bounds.
CUDA_BLOCK_SHARE = 1 / 8
CUDA_BLOCK_MIN_MB = 64.0
CUDA_BLOCK_CAP_MB = 2048.0
# CUDA: the Jacobian kept for backward may take this share of what is left after one block.
CUDA_SAVED_SHARE = 0.5

_MB = 2**20
_NO_LIMIT = 2**62  # bytes: what float("inf") megabytes mean


def _bytes(megabytes: float) -> int:
    return int(min(megabytes * _MB, _NO_LIMIT))


def cuda_available_bytes(device: torch.device) -> int:
    """Bytes the caching allocator can still hand out: free on the device plus cached-but-unused blocks."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + max(cached, 0))


def host_available_bytes() -> int:
    """MemAvailable of the host (what can be allocated without swapping), or a huge number if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return _NO_LIMIT


def memory_budgets(
    device: torch.device, memory_budget_mb: float | None, saved_budget_mb: float | None
) -> tuple[int, int]:
    """(block bytes, saved bytes) for a call on ``device``; explicit megabytes win over the device default.

    CPU: blocks of 64 MB; the Jacobian is streamed only when it would not fit in the host's available
    memory (where the saved path could not run at all), so every CPU call that worked before is unchanged.
    CUDA: blocks of 1/8 of the available device memory within [64 MB, 2 GB]; the Jacobian may take half
    of what is available after one block.
    """
    if device.type == "cuda":
        available = cuda_available_bytes(device)
        block = (
            _bytes(memory_budget_mb)
            if memory_budget_mb is not None
            else int(min(max(available * CUDA_BLOCK_SHARE, CUDA_BLOCK_MIN_MB * _MB), CUDA_BLOCK_CAP_MB * _MB))
        )
        saved = (
            _bytes(saved_budget_mb)
            if saved_budget_mb is not None
            else int(max(available - block, 0) * CUDA_SAVED_SHARE)
        )
        return block, saved
    block = _bytes(DEFAULT_MEMORY_BUDGET_MB if memory_budget_mb is None else memory_budget_mb)
    saved = _bytes(saved_budget_mb) if saved_budget_mb is not None else host_available_bytes()
    return block, saved
