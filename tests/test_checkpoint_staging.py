"""Checkpoint staging directories: a worker killed before Ray uploaded its checkpoint leaves one behind (about
130 MB for the quickstart's resnet18 and Adam state); the next checkpoint on the node removes it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from dmltrain.service.checkpoints import STAGING_PREFIX, remove_stale_staging, staging_directory


def _exited_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_staging_directories_of_exited_writers_are_removed_and_no_others(tmp_path: Path) -> None:
    host = socket.gethostname()
    dead = tmp_path / f"{STAGING_PREFIX}{_exited_pid()}@{host}~abc123"
    dead.mkdir()
    (dead / "state.pt").write_bytes(b"x" * 1000)
    mine = tmp_path / f"{STAGING_PREFIX}{os.getpid()}@{host}~def456"
    other_host = tmp_path / f"{STAGING_PREFIX}{_exited_pid()}@not-{host}~ghi789"
    unnamed = tmp_path / f"{STAGING_PREFIX}oldstyle1"  # written before directories carried their owner
    for path in (mine, other_host, unnamed):
        path.mkdir()

    fresh = Path(staging_directory(tmp_path))

    assert not dead.exists()
    assert mine.is_dir() and other_host.is_dir() and unnamed.is_dir()
    assert fresh.is_dir() and fresh.name.startswith(f"{STAGING_PREFIX}{os.getpid()}@{host}~")
    assert remove_stale_staging(tmp_path) == []
