"""The process-wide MLflow tracking URI for one block of fluent-API calls."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (Model.log, register_model, the logged-model lookup behind runs:/) reads the
    process-wide URI: set it for one block and restore the caller's afterwards (MLflow's own helper)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(uri):
        yield
