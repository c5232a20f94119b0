"""One block of MLflow calls with process-wide settings: the fluent API's tracking URI, download bars."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's fluent API (Model.log, register_model, the logged-model lookup behind runs:/) reads the
    process-wide URI: set it for one block and restore the caller's afterwards (MLflow's own helper)."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(uri):
        yield


_BARS = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


@contextlib.contextmanager
def no_artifact_bars(quiet: bool = True) -> Iterator[None]:
    """Without MLflow's download bars in this block (when ``quiet``): a "download" from a local store is a
    copy that takes no time, and each drew a bar per file list (two or three a model, 116 steps each);
    logging a model loads it back to check its input example, a download too. A user's own
    MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR is left as it is."""
    if not quiet or _BARS in os.environ:
        yield
        return
    os.environ[_BARS] = "false"
    try:
        yield
    finally:
        os.environ.pop(_BARS, None)


def is_local_store(uri: str) -> bool:
    """A tracking store on this machine (sqlite, file), whose artifacts are too, unless set otherwise."""
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri
