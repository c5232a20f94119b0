"""Where a profiled step left the GPU idle: busy time, idle gaps and waits, from a torch.profiler trace.

    python bench/trace_gaps.py trace_steps_32-32.json.gz [more traces]

The traces are what `train.profile_start` logs to a run's MLflow page (profile/trace_steps_*.json.gz) and
what bench/gpu.py and bench/device_checks.sh bring back (traces-*.tgz). For each trace, over the span of
its profiled step(s): the device's busy time (the union of its kernels, copies and memsets on every
stream) and its share of the step, each stream's busy time, the largest idle gaps with their offsets in
the step, the idle time in gaps over 1 ms, and the host's synchronising CUDA calls (a training thread that
waits for the GPU cannot queue work ahead of it). That is how the service's profiled steps were read
(README, "Decoding on the GPU").
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


@dataclass
class StepGaps:
    step_us: float
    busy_us: float
    streams: dict[Any, tuple[int, float]]  # stream: (operations, busy us)
    gaps: list[tuple[float, float]]  # (idle us, offset us in the step), largest first
    syncs: dict[str, int] = field(default_factory=dict)

    def idle_in_gaps_over(self, us: float) -> float:
        return sum(g for g, _ in self.gaps if g > us)


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union(
    spans: list[tuple[float, float]], start: float, end: float
) -> tuple[float, list[tuple[float, float]]]:
    """Covered time of `spans` clipped to [start, end), and the uncovered gaps (length, offset)."""
    busy, gaps, cursor = 0.0, [], start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in spans if a < end and b > start):
        if a > cursor:
            gaps.append((a - cursor, cursor - start))
        if b > cursor:
            busy += b - max(a, cursor)
            cursor = b
    if end > cursor:
        gaps.append((end - cursor, cursor - start))
    return busy, gaps


def step_gaps(events: list[dict[str, Any]]) -> StepGaps:
    """The profiled steps' span (ProfilerStep annotations) and the device's use of it."""
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep")]
    if not steps:
        raise ValueError("no ProfilerStep in the trace: was it recorded with torch.profiler's schedule?")
    start = min(e["ts"] for e in steps)
    end = max(e["ts"] + e["dur"] for e in steps)
    device = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES]
    busy, gaps = _union([(e["ts"], e["ts"] + e["dur"]) for e in device], start, end)
    by_stream: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    for e in device:
        by_stream[e.get("args", {}).get("stream")].append((e["ts"], e["ts"] + e["dur"]))
    streams = {}
    for stream, spans in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        inside = [s for s in spans if s[0] < end and s[1] > start]
        if inside:
            streams[stream] = (len(inside), _union(inside, start, end)[0])
    syncs = Counter(
        e["name"]
        for e in events
        if e.get("cat") == "cuda_runtime" and e.get("name") in SYNC_CALLS and start <= e["ts"] < end
    )
    return StepGaps(end - start, busy, streams, sorted(gaps, reverse=True), dict(syncs))


def report(path: Path, gaps: StepGaps, top: int = 8) -> str:
    ms = 1e-3
    lines = [
        f"{path.name}: step {gaps.step_us * ms:.0f} ms, device busy {gaps.busy_us * ms:.0f} ms "
        f"({gaps.busy_us / gaps.step_us:.0%}), idle {gaps.idle_in_gaps_over(1000) * ms:.0f} ms in gaps "
        "over 1 ms"
    ]
    for stream, (ops, busy) in gaps.streams.items():
        lines.append(f"  stream {stream}: {ops} operations, busy {busy * ms:.0f} ms")
    largest = ", ".join(f"{g * ms:.1f} ms at {at * ms:.0f}" for g, at in gaps.gaps[:top])
    lines.append(f"  largest idle gaps: {largest}")
    waits = ", ".join(f"{name} {n}" for name, n in sorted(gaps.syncs.items())) or "none"
    lines.append(f"  host waits for the device: {waits}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "traces", nargs="+", type=Path, help="torch.profiler Chrome traces (.json or .json.gz)"
    )
    parser.add_argument("--top", type=int, default=8, help="largest gaps to list")
    args = parser.parse_args()
    for path in args.traces:
        print(report(path, step_gaps(load_events(path)), args.top))


if __name__ == "__main__":
    main()
