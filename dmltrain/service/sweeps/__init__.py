"""Sweeps: a grid of experiments run as one Ray Tune experiment, tracked as one MLflow parent run with a
nested child run per trial (``dmltrain sweep SWEEP.yaml``; sweep files in ``configs/sweeps/``).

- `spec`: the sweep file (base config + dotted overrides, variants x grid) and its trials;
- `trial`: the Tune function trainable, one full service launch per trial;
- `driver`: checks before Ray, the parent run, baselines, ``ray.tune.Tuner``;
- `summary`: the trials' results read back from MLflow, tables and comparison plots;
- `baselines`: retrieval on raw pixels.
"""

from dmltrain.service.sweeps.driver import SweepOutcome, run_sweep
from dmltrain.service.sweeps.spec import Sweep, SweepSpec, Trial, load_sweep

__all__ = ["Sweep", "SweepOutcome", "SweepSpec", "Trial", "load_sweep", "run_sweep"]
