"""Processes on this machine: whether one still exists (clean-up of what exited processes left behind,
checkpoint staging folders and test beds, must never touch what a live one still uses) and which ones run
below another (Ray's process tree)."""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists in this PID namespace; another user's process counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def parent_pid(pid: int) -> int | None:
    """``pid``'s parent, None once it has exited."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def children_by_parent() -> dict[int, list[int]]:
    """Every process in this PID namespace under its parent (Linux /proc; one snapshot)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            parent = parent_pid(int(entry.name))
            if parent is not None:
                children[parent].append(int(entry.name))
    return children


def subtree(root: int, children: dict[int, list[int]]) -> list[int]:
    """``root`` and every process below it in ``children`` (from `children_by_parent`)."""
    found, todo = [], [root]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found
