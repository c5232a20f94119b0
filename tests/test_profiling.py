"""The step profiler (train.profile_start): what it records, and when its files appear."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch

from dmltrain.service.profiling import StepProfiler


def _steps(profiler: StepProfiler, count: int) -> dict[int, list[Path]]:
    """Runs `count` tiny training steps (1-based) under the profiler; the files each step returned."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    returned = {}
    for step in range(1, count + 1):
        profiler.before_step(step)
        optimizer.zero_grad()
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
        returned[step] = profiler.after_step(step)
    return returned


def _recorded_steps(trace: Path) -> list[str]:
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    return sorted({e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#")})


def test_records_the_asked_steps_after_an_unrecorded_warm_up(tmp_path: Path) -> None:
    profiler = StepProfiler(3, 2, torch.device("cpu"), tmp_path)
    returned = _steps(profiler, 6)
    ops, trace = tmp_path / "ops_steps_3-4.txt", tmp_path / "trace_steps_3-4.json.gz"
    assert returned == {1: [], 2: [], 3: [], 4: [ops, trace], 5: [], 6: []}
    table = ops.read_text()
    assert "steps 3-4 on cpu" in table and "aten::addmm" in table  # the model's operators, by CPU time
    assert _recorded_steps(trace) == ["ProfilerStep#1", "ProfilerStep#2"]  # step 2 was the warm-up (#0)


def test_a_profile_from_the_first_step_has_no_warm_up(tmp_path: Path) -> None:
    returned = _steps(StepProfiler(1, 1, torch.device("cpu"), tmp_path), 2)
    assert returned[1] == [tmp_path / "ops_steps_1-1.txt", tmp_path / "trace_steps_1-1.json.gz"]
    assert returned[2] == []
    assert _recorded_steps(tmp_path / "trace_steps_1-1.json.gz") == ["ProfilerStep#0"]


def test_a_window_the_run_has_passed_records_nothing(tmp_path: Path) -> None:
    profiler = StepProfiler(2, 1, torch.device("cpu"), tmp_path)
    for step in (5, 6):  # a run resumed past the window
        profiler.before_step(step)
        assert profiler.after_step(step) == []
    assert not list(tmp_path.iterdir())


def test_without_a_folder_the_files_go_to_a_new_temporary_one() -> None:
    files = _steps(StepProfiler(2, 1, torch.device("cpu")), 2)[2]
    try:
        assert [f.name for f in files] == ["ops_steps_2-2.txt", "trace_steps_2-2.json.gz"]
        assert files[0].parent.name.startswith("dmltrain-profile-") and all(f.is_file() for f in files)
    finally:
        shutil.rmtree(files[0].parent)


@pytest.mark.parametrize(("first", "steps"), [(0, 1), (1, 0)])
def test_bad_windows_are_refused(tmp_path: Path, first: int, steps: int) -> None:
    with pytest.raises(ValueError, match="first >= 1 and steps >= 1"):
        StepProfiler(first, steps, torch.device("cpu"), tmp_path)
