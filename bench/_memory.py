"""Process memory figures from /proc for the benchmarks (Linux): the current and peak resident set, and a
reset of the peak so one measured step's high-water mark is its own."""

from __future__ import annotations

from pathlib import Path


def status_kb(field: str) -> int:
    """A kB figure of /proc/self/status, e.g. VmRSS (resident now) or VmHWM (peak resident)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    """Set VmHWM back to the current RSS; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
