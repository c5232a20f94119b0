"""bench/trace_gaps.py reads a profiled step's device time right: busy as the union over streams, the gaps
where nothing ran, and the host's waits inside the step only (a synthetic trace with known answers)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

from trace_gaps import load_events, report, step_gaps  # bench/trace_gaps.py


def _x(name: str, cat: str, ts: float, dur: float, **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "args": args}


EVENTS = [
    _x("ProfilerStep#1", "user_annotation", 1000, 1000),
    _x("k1", "kernel", 900, 300, stream=7),  # starts before the step: only 200 us count
    _x("k2", "kernel", 1150, 100, stream=7),  # overlaps k1 and the copy: counted once
    _x("copy", "gpu_memcpy", 1220, 80, stream=17),
    _x("k3", "kernel", 1500, 200, stream=7),  # gap 1300-1500 before it
    _x("k4", "kernel", 1950, 200, stream=7),  # gap 1700-1950; runs past the step's end
    _x("cudaStreamSynchronize", "cuda_runtime", 1310, 150),
    _x("cudaStreamSynchronize", "cuda_runtime", 2500, 10),  # after the step: not counted
    _x("cudaLaunchKernel", "cuda_runtime", 1400, 5),
]


def test_busy_time_gaps_and_waits_of_a_known_step(tmp_path: Path) -> None:
    path = tmp_path / "trace_steps_1-1.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    gaps = step_gaps(load_events(path))
    assert gaps.step_us == 1000
    # covered: 1000-1300 (k1, k2, copy), 1500-1700 (k3), 1950-2000 (k4 clipped)
    assert gaps.busy_us == pytest.approx(300 + 200 + 50)
    assert gaps.gaps == [(250, 700), (200, 300)]
    assert gaps.idle_in_gaps_over(220) == 250
    assert gaps.streams == {7: (4, 250 + 200 + 50), 17: (1, 80)}
    assert gaps.syncs == {"cudaStreamSynchronize": 1}
    text = report(path, gaps)
    assert "device busy 1 ms (55%)" in text and "0.2 ms at 1" in text


def test_a_trace_without_a_profiled_step_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": EVENTS[1:]}))
    with pytest.raises(ValueError, match="no ProfilerStep"):
        step_gaps(load_events(path))
