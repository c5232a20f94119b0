"""One logging setup for every service process (driver, Ray Train workers, sweeps).

The service logs at INFO so a run's progress shows in `ray job logs`. Some libraries log routine events at
INFO that read like faults there: faiss's loader reports the separate AVX2 build it first looks for (wheels
that ship one dynamically dispatched build never have it) as a ModuleNotFoundError before loading the build
they do have. Those loggers are kept at WARNING, so a real failure to load still shows.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
QUIET_LOGGERS = ("faiss.loader",)


def setup_logging(level: int = logging.INFO) -> None:
    """Root logging at `level` with the service's format (a no-op for the root if already configured)."""
    logging.basicConfig(level=level, format=FORMAT)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
