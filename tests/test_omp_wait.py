"""scaling.omp_wait_policy holds in a real process: idle OpenMP threads spin or sleep as the policy says,
whatever GOMP_SPINCOUNT the driver's environment passes down (in GNU OpenMP the count beats the policy)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dmltrain.service.run import OMP_WAIT_ENV, OMP_WAIT_KEYS

# One parallel region over 2 threads (ATen's parallel_for is OpenMP in torch's Linux wheels), then the
# CPU the process burns while its main thread sleeps: the idle OpenMP thread's spinning.
_IDLE_SPIN = """
import time, torch
torch.set_num_threads(2)
x = torch.ones(4_000_000)
for _ in range(20):
    x.add_(1)
start = time.process_time()
time.sleep(1.0)
print(time.process_time() - start)
"""


def _gnu_openmp_loaded() -> bool:
    """torch's intra-op threads are GNU OpenMP's (torch's Linux wheels): the runtime GOMP_SPINCOUNT is for."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        with open("/proc/self/maps") as maps:
            return "libgomp" in maps.read()
    except OSError:
        return False


needs_gnu_openmp = pytest.mark.skipif(not _gnu_openmp_loaded(), reason="torch's threads are not GNU OpenMP's")


def _idle_cpu_seconds(env: dict[str, str]) -> float:
    clean = {k: v for k, v in os.environ.items() if k not in OMP_WAIT_KEYS}
    out = subprocess.run(
        [sys.executable, "-c", _IDLE_SPIN], env={**clean, **env}, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip())


@needs_gnu_openmp
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 CPUs for a second OpenMP thread")
def test_policy_holds_against_an_inherited_spin_count() -> None:
    # A spinning thread burns about 1.0 s of the 1.0, a sleeping one < 0.01: thresholds far from both ends.
    # Without their own count (OMP_WAIT_POLICY alone) both cases below fail: the inherited count wins.
    passive = _idle_cpu_seconds({"GOMP_SPINCOUNT": "infinite", **OMP_WAIT_ENV["passive"]})
    active = _idle_cpu_seconds({"GOMP_SPINCOUNT": "0", **OMP_WAIT_ENV["active"]})
    assert passive < 0.1, f"passive: idle thread burned {passive:.2f} s of 1.0"
    assert active > 0.3, f"active: idle thread burned only {active:.2f} s of 1.0"
