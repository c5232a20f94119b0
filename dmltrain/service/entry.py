"""``python -m dmltrain.run CONFIG [key.sub=value ...]``: the command line, light enough to fail fast.

Reading and validating the config needs only pydantic and YAML (about 0.2 s); the launch behind it imports
torch, torchvision, Ray and MLflow (5-7 s on a 2-core machine). So the config is read here first and the
launch is imported only once it is valid: a typo in a key gets its one line in well under a second.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from dmltrain.service.config import ConfigError, load_config
from dmltrain.service.logs import print_problems, setup_logging
from dmltrain.versions import VersionAction


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dmltrain.run",
        description="Train an embedding network with a ranking loss on Ray Train, tracked in MLflow.",
    )
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("config", help="experiment YAML, e.g. configs/quickstart.yaml")
    parser.add_argument(
        "overrides", nargs="*", default=[], help="dotted overrides such as train.steps=100 optim.lr=1e-4"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, validate, then launch; the exit status is 2 for a config or data mistake (one line each)."""
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        config = load_config(args.config, args.overrides)
    except ConfigError as error:
        print_problems(error)
        return 2
    from dmltrain.service.run import run_and_report  # the heavy part: torch, Ray, MLflow

    return run_and_report(config)


STOPPED = (128 + signal.SIGINT, 128 + signal.SIGTERM)  # run_and_report's statuses for a stopped run


def exit_process(code: int) -> NoReturn:
    """End the command with ``code``. After a stop (SIGTERM, Ctrl-C) the thread that runs
    ``trainer.fit()`` is still inside Ray: at interpreter exit Ray's own shutdown raced with it, and Ray's
    core worker then ended the process with status 1 ("The core worker has already been shutdown ... The
    process will exit") instead of 143, now and then. The run is already marked KILLED and Ray ends the
    job's actors when its driver goes, so a stopped command flushes its output and leaves at once."""
    if code in STOPPED:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
