"""Which worker failures a restart can fix, and stopping Ray Train from retrying the others.

``run.max_failures`` exists for lost nodes and killed workers: Ray restarts the worker group from the last
checkpoint. A wrong backbone name, a missing weights file, a shard that is not where dataset.json says or a
diverging loss fail the same way on every attempt, so retrying only delays the error three times. Workers
wrap such errors in :class:`FatalRunError`; :class:`StopOnFatalError`, a Ray Train callback on the
controller (``dmltrain.service.callbacks``), turns one into a controller error, which Ray Train's failure
policy never retries. This module stays free of Ray so the worker loop can use it anywhere.
"""

from __future__ import annotations

from dmltrain.data.errors import SampleError, SamplingError, SharedMemoryError
from dmltrain.data.shards import ShardError
from dmltrain.service.best import BestMetricError


class FatalRunError(RuntimeError):
    """A failure that fails again on every restart (config, data layout, weights): never retried.

    ``explained``: the message is the whole story (a damaged image or shard, a diverging loss), so the
    tracebacks Ray Train logs for it are cut to that message (dmltrain.service.logs.ExplainedErrors).
    Pickled with the exception, so the controller and the driver see it too.
    """

    def __init__(self, message: str, *, explained: bool = False) -> None:
        super().__init__(message)
        self.explained = explained


class NonFiniteEmbeddingsError(ValueError):
    """The network embeds images of an evaluated split as NaN/inf: the same evaluation fails the same way
    from the last checkpoint (diverged weights, inputs that overflow), so a restart only repeats it."""


# Raised while a worker sets up (model, data plan, weights): no restart makes them go away. Errors of the
# training loop itself are retried unless listed in FATAL_IN_LOOP (a lost peer shows up as RuntimeError);
# what the data causes (a damaged shard or image, a batch its classes cannot fill) replays on a restart.
# A node whose /dev/shm cannot hold what the loaders keep there stays so across restarts.
FATAL_IN_SETUP = (ValueError, KeyError, TypeError, FileNotFoundError, ImportError, SharedMemoryError)
FATAL_IN_LOOP = (
    ShardError,
    SampleError,
    SamplingError,
    SharedMemoryError,
    BestMetricError,
    NonFiniteEmbeddingsError,
)


def as_fatal(exc: BaseException, rank: int, phase: str, *, explained: bool = False) -> FatalRunError:
    """A one-line FatalRunError naming the rank and phase, chained to ``exc``."""
    return FatalRunError(
        f"rank {rank} {phase}: {type(exc).__name__}: {_first_line(exc)}", explained=explained
    )


def _first_line(exc: BaseException) -> str:
    """The first line of the error's own message. A DataLoader worker's error is re-raised in the main
    process with a message that starts "Caught X in DataLoader worker process N." and holds the worker's
    traceback: its own message (the one naming the shard or sample) is on the line "module.X: ..."."""
    text = str(exc).strip()
    if text.startswith("Caught ") and "Original Traceback" in text:
        name = type(exc).__name__
        for line in text.splitlines():
            head, sep, message = line.partition(": ")
            if sep and not line.startswith(" ") and head.rpartition(".")[2] == name:
                return message.strip()
    return (text.splitlines() or [""])[0]


def fatal_cause(error: BaseException | None) -> FatalRunError | None:
    """The FatalRunError behind what ``TorchTrainer.fit`` raised (a ControllerError wraps it), if any."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, FatalRunError):
            return error
        error = getattr(error, "controller_failure", None) or error.__cause__
        seen += 1
    return None
