"""The service's logging setup: INFO for dmltrain, routine library chatter kept out of run logs."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest


def test_faiss_loader_chatter_is_hidden_but_its_warnings_are_not() -> None:
    pytest.importorskip("faiss")
    code = (
        "import logging\n"
        "from dmltrain.service.logs import setup_logging\n"
        "setup_logging()\n"
        "logging.getLogger('dmltrain.check').info('dmltrain info shows')\n"
        "import faiss\n"
        "logging.getLogger('faiss.loader').warning('faiss warning shows')\n"
    )
    # A fresh interpreter: faiss logs while it is first imported, which this test process has done already.
    stderr = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stderr
    assert "dmltrain info shows" in stderr
    assert "faiss warning shows" in stderr
    assert "Loading faiss" not in stderr and "Could not load" not in stderr, stderr


def test_setup_logging_keeps_quiet_loggers_at_warning_or_above() -> None:
    from dmltrain.service.logs import QUIET_LOGGERS, setup_logging

    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    try:
        setup_logging(logging.DEBUG)
        assert all(logging.getLogger(name).level == logging.WARNING for name in QUIET_LOGGERS)
        setup_logging(logging.ERROR)
        assert all(logging.getLogger(name).level == logging.ERROR for name in QUIET_LOGGERS)
    finally:  # the loggers are process-wide: later tests see them as they were
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
