"""One logging setup for every service process (driver, Ray Train workers, sweeps).

The service logs at INFO so a run's progress shows in `ray job logs`. Some libraries log routine events at
INFO that read like faults there: faiss's loader reports the separate AVX2 build it first looks for (wheels
that ship one dynamically dispatched build never have it) as a ModuleNotFoundError before loading the build
they do have; Tune's TensorBoard logger calls every metric name with an ``@`` (``recall@1``) "illegal" as it
renames it. Those loggers are kept at WARNING, so a real failure still shows.

Ray (2.5x) logs a WARNING at every start of a local cluster that it turned token authentication on, its
default for new clusters: nothing to act on, and authentication stays on. That one message is dropped; the
warning that authentication is *off* is not.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Sequence

from tqdm import tqdm

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
QUIET_LOGGERS = ("faiss.loader", "tensorboardX.summary")
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_ON_NOTICE = "Token authentication is enabled for this Ray cluster"
# Ray Train's loggers that print a failed run's error with its traceback: the worker's, and the
# controller's (its control loop and its failure policy).
WORKER_LOGGERS = ("ray.train.v2._internal.util",)
CONTROLLER_LOGGERS = (
    "ray.train.v2._internal.execution.controller.controller",
    "ray.train.v2._internal.execution.failure_handling.default",
)
# Ray Train logs every ray.train.report in the worker at INFO with the whole metrics dict: a long line per
# checkpoint repeating what the run logs itself. Its logger is named after its file's path.
RAY_REPORT_MODULE = "ray.train.v2._internal.execution.context"
RAY_REPORT_NOTICE = "Reporting training result"
FULL_TRACEBACKS_ENV = "DMLTRAIN_FULL_TRACEBACKS"  # =1: keep Ray's tracebacks of explained errors
LOGGED_PROGRESS_SECONDS = 10.0  # a progress bar without a terminal redraws at most this often


def progress_bar(total: int, desc: str, *, enabled: bool = True) -> tqdm:
    """A tqdm bar (images) for long work in a service process, e.g. a worker's evaluation.

    Ray forwards a worker's output to the driver and to ``ray job logs`` line by line, so every redraw of
    an ordinary bar arrives as a line of its own (43 per evaluation of the quickstart). Without a terminal
    the bar redraws at most every LOGGED_PROGRESS_SECONDS and its last line stays, as a log would have it.
    """
    interactive = sys.stderr.isatty()
    return tqdm(
        total=total,
        desc=desc,
        unit="img",
        disable=not enabled,
        leave=not interactive,
        mininterval=0.1 if interactive else LOGGED_PROGRESS_SECONDS,
        file=sys.stderr,
    )


class _DropNotice(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def setup_logging(level: int = logging.INFO) -> None:
    """Root logging at `level` with the service's format (a no-op for the root if already configured)."""
    logging.basicConfig(level=level, format=FORMAT)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(level, logging.WARNING))
    drop_notice(RAY_AUTH_LOGGER, RAY_AUTH_ON_NOTICE)


def quiet_ray_reports() -> None:
    """In a Ray Train worker: drop Ray's line per ``ray.train.report`` (checkpoints still log theirs)."""
    try:
        module = importlib.import_module(RAY_REPORT_MODULE)
    except ImportError:  # another Ray layout: its lines stay
        return
    drop_notice(module.__file__ or RAY_REPORT_MODULE, RAY_REPORT_NOTICE)


def drop_notice(logger: str, prefix: str) -> None:
    """Drop the records of `logger` that start with `prefix` (once, however often it is asked)."""
    target = logging.getLogger(logger)
    if not any(isinstance(f, _DropNotice) and f.prefix == prefix for f in target.filters):
        target.addFilter(_DropNotice(prefix))


def print_problems(error: BaseException) -> None:
    """A config or data error on stderr, one ``error:`` line per problem (indented lines continue the one
    above): what ``python -m dmltrain.run`` and ``dmltrain sweep`` print before exiting with status 2."""
    for line in str(error).splitlines():
        print(line if line.startswith(" ") else f"error: {line}", file=sys.stderr)


def full_tracebacks() -> bool:
    """Whether the user asked for Ray's full tracebacks of explained errors too (read on the driver)."""
    return os.environ.get(FULL_TRACEBACKS_ENV, "") not in ("", "0")


class ExplainedErrors(logging.Filter):
    """Cuts a record about an explained FatalRunError (a damaged image, a diverging loss) to one line.

    Ray Train logs a failing worker's error with its traceback in the worker, then twice in the controller:
    about 90 lines above the driver's one ``error:`` line, for a message that already names the sample and
    shard. The record keeps its first line and gets the error's message instead of the traceback. The
    error is found as the record's exception or, for the worker's record (a formatted traceback string
    logged inside its ``except`` block), as the exception being handled.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from dmltrain.service.errors import fatal_cause

        error = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        fatal = fatal_cause(error)
        if fatal is None or not getattr(fatal, "explained", False):
            return True
        head = record.getMessage().splitlines()[0].rstrip(": ")
        message = str(fatal)
        record.msg = head if message in head else f"{head}: {message}"
        record.args, record.exc_info, record.exc_text = None, None, None
        return True


def shorten_explained_errors(loggers: Sequence[str]) -> None:
    """Install :class:`ExplainedErrors` on `loggers` (once each)."""
    for name in loggers:
        target = logging.getLogger(name)
        if not any(isinstance(f, ExplainedErrors) for f in target.filters):
            target.addFilter(ExplainedErrors())
