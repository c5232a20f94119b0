"""Shared test fixtures: one real local Ray cluster per test session, loopback-only networking."""

from __future__ import annotations

import os

# Keep every Ray and gloo listener on loopback and never phone home; must precede `import ray`.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TQDM_DISABLE", "1")

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """Start one local Ray cluster for the whole session (a start-up costs ~7 s here).

    Logical CPUs are raised above the 2 physical cores so a 2-worker TorchTrainer plus its controller fit.
    Only the cluster started here is shut down; a developer's own `ray start` is left alone.
    """
    import ray

    if ray.is_initialized():
        yield ray
        return
    # The tests' objects take a few MB; a small store bounds what Ray maps (or writes to /tmp, where
    # /dev/shm is too small for its default of 30% of memory).
    ray.init(
        num_cpus=4,
        object_store_memory=512 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def glyphs_root(tmp_path_factory: pytest.TempPathFactory):
    """The embedded glyph data set, built once per session (the quickstart's bundled data)."""
    from dmltrain.data import ensure_glyphs

    return ensure_glyphs(tmp_path_factory.mktemp("glyphs"))
