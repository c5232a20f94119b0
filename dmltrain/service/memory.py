"""The training process's peak resident memory, for the ``train/peak_rss_mb`` metric.

Linux keeps the high-water mark of a process's resident set (VmHWM) and lets the process set it back to the
current size (``/proc/self/clear_refs``); the worker loop resets it after every evaluation, so the figure it
logs is the peak of its training steps, not of embedding the test split. Elsewhere the figure is the
process's lifetime peak (``ru_maxrss``) and the reset does nothing.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path


def peak_rss_mb() -> float:
    """Peak resident set of this process in MiB since the last :func:`reset_peak_rss`."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def reset_peak_rss() -> bool:
    """Set the high-water mark back to the current resident set; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
