"""The service's logging setup: INFO for dmltrain, routine library chatter kept out of run logs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from dmltrain.service.logs import progress_bar


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


@pytest.mark.service
def test_rays_token_auth_notice_is_dropped_and_auth_stays_on(tmp_path) -> None:
    """A local Ray start logs that token authentication is on; the service's setup drops that one WARNING
    (the same start without it shows it, so a Ray that stops logging it fails here) and auth stays on."""
    pytest.importorskip("ray")
    code = (
        "import os, sys, ray\n"
        "if sys.argv[1] == 'setup':\n"
        "    from dmltrain.service.logs import setup_logging\n"
        "    setup_logging()\n"
        "ray.init(num_cpus=1, include_dashboard=False)\n"
        "print('auth mode', os.environ.get('RAY_AUTH_MODE'))\n"
        "ray.shutdown()\n"
    )
    env = {**os.environ, "HOME": str(tmp_path), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_ADDRESS", None)
    runs = {
        mode: subprocess.run(
            [sys.executable, "-c", code, mode],
            capture_output=True,
            text=True,
            check=True,
            timeout=180,
            env=env,
        )
        for mode in ("plain", "setup")
    }
    assert "Token authentication is enabled for this Ray cluster" in runs["plain"].stderr
    assert "Token authentication is enabled" not in runs["setup"].stderr, runs["setup"].stderr
    assert "auth mode token" in runs["setup"].stdout


def test_a_progress_bar_without_a_terminal_draws_its_first_and_last_lines_only(capsys) -> None:
    # pytest captures stderr into a file: no terminal, as in a Ray worker (whose output Ray forwards line
    # by line, so each redraw would reach the driver as a line of its own).
    bar = progress_bar(10_000, "embed test")
    for _ in range(100):  # 0.5 s: an ordinary bar (redrawn every 0.1 s at most) would draw about 6 lines
        time.sleep(0.005)
        bar.update(100)
    bar.close()
    drawn = [line for line in capsys.readouterr().err.replace("\r", "\n").split("\n") if line.strip()]
    assert len(drawn) == 2, drawn
    assert "0/10000" in drawn[0] and "10000/10000" in drawn[1]  # the last line stays
    silent = progress_bar(10, "embed test", enabled=False)  # ranks other than 0
    silent.update(10)
    silent.close()
    assert capsys.readouterr().err == ""


def test_rays_line_per_report_is_dropped_in_workers_and_checkpoint_lines_stay() -> None:
    pytest.importorskip("ray")
    import importlib
    import inspect
    import logging

    from dmltrain.service.logs import RAY_REPORT_MODULE, RAY_REPORT_NOTICE, quiet_ray_reports

    module = importlib.import_module(RAY_REPORT_MODULE)
    assert RAY_REPORT_NOTICE in inspect.getsource(module)  # Ray still logs it there: the filter is not dead
    quiet_ray_reports()
    quiet_ray_reports()  # once, however often asked
    logger = logging.getLogger(module.__file__)
    report = logger.makeRecord(logger.name, logging.INFO, "f", 1, f"{RAY_REPORT_NOTICE} 1: ...", (), None)
    other = logger.makeRecord(logger.name, logging.INFO, "f", 1, "Checkpoint successfully created", (), None)
    assert not logger.filter(report) and logger.filter(other)
    assert len(logger.filters) == 1
