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

import logging
import sys

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
QUIET_LOGGERS = ("faiss.loader", "tensorboardX.summary")
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_AUTH_ON_NOTICE = "Token authentication is enabled for this Ray cluster"


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
