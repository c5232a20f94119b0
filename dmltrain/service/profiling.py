"""A torch.profiler recording of a few training steps (``train.profile_start``), for the run's MLflow page.

Why: the phase times the loop logs say how long data, engine and update take, not why; on a GPU the
question is usually where the device sits idle (host launch gaps, synchronisations, the data path's kernels
on the side stream). One recording of a few steady-state steps answers it: a Chrome/Perfetto trace (every
CUDA kernel of every stream, the training thread's operators) and a table of the operators by device time
(CPU time on a CPU). It costs nothing when off and only the recorded steps when on.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule


class StepProfiler:
    """Records steps ``first`` .. ``first + steps - 1`` (1-based, as the log lines count them), after one
    unrecorded warm-up step where there is one, and writes ``trace_steps_A-B.json.gz`` and
    ``ops_steps_A-B.txt`` to ``out_dir`` (default: a new temporary folder, made only if the steps run).

    Call `before_step(n)` before step n runs and `after_step(n)` after it; `after_step` returns the files
    once the last recorded step is done (else an empty list).
    """

    def __init__(
        self, first: int, steps: int, device: torch.device, out_dir: Path | None = None, row_limit: int = 60
    ) -> None:
        if first < 1 or steps < 1:
            raise ValueError(f"profile needs first >= 1 and steps >= 1, got first={first}, steps={steps}")
        self.first, self.last = first, first + steps - 1
        self.warmup = 1 if first > 1 else 0
        self.start = first - self.warmup  # the step the profiler starts before (the warm-up, if any)
        self.device, self.out_dir, self.row_limit = device, out_dir, row_limit
        self._profiler: profile | None = None
        self._files: list[Path] = []

    @property
    def name(self) -> str:
        return f"steps_{self.first}-{self.last}"

    def before_step(self, step: int) -> None:
        if self._profiler is None and step == self.start:
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            self._profiler = profile(
                activities=activities,
                schedule=schedule(wait=0, warmup=self.warmup, active=self.last - self.first + 1, repeat=1),
                on_trace_ready=self._write,
            )
            self._profiler.start()

    def after_step(self, step: int) -> list[Path]:
        if self._profiler is None or not self.start <= step <= self.last:
            return []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's kernels belong to the step
        self._profiler.step()  # after the last recorded step this calls _write
        if step < self.last:
            return []
        self._profiler.stop()
        self._profiler = None
        return self._files

    def _write(self, prof: profile) -> None:
        out = Path(self.out_dir or tempfile.mkdtemp(prefix="dmltrain-profile-"))
        out.mkdir(parents=True, exist_ok=True)
        trace = out / f"trace_{self.name}.json.gz"
        prof.export_chrome_trace(str(trace))
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort_by, row_limit=self.row_limit)
        ops = out / f"ops_{self.name}.txt"
        ops.write_text(
            f"torch.profiler, steps {self.first}-{self.last} on {self.device}, operators by "
            f"{sort_by.replace('_', ' ')}; the trace opens in https://ui.perfetto.dev or chrome://tracing\n\n"
            + table
            + "\n"
        )
        self._files = [ops, trace]
