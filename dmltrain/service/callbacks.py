"""Ray Train callbacks the driver installs on the controller."""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback

from dmltrain.service.errors import FatalRunError
from dmltrain.service.logs import CONTROLLER_LOGGERS, shorten_explained_errors


class StopOnFatalError(UserCallback):
    """Runs on the Ray Train controller: a worker's FatalRunError ends the run instead of a retry.

    Ray Train treats every worker error as retryable, but an exception raised by a callback becomes a
    ControllerError, which its default failure policy raises at once.
    """

    def __init__(self, full_tracebacks: bool = False) -> None:
        self.full_tracebacks = full_tracebacks  # decided on the driver (its environment), used here

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        fatal = {rank: e for rank, e in worker_exceptions.items() if isinstance(e, FatalRunError)}
        if fatal:
            first = fatal[min(fatal)]
            explained = getattr(first, "explained", False)
            if explained and not self.full_tracebacks:
                shorten_explained_errors(CONTROLLER_LOGGERS)  # the controller logs what this raises
            raise FatalRunError(str(first), explained=explained)
