"""Whether a process still exists: clean-up of what exited processes left behind (checkpoint staging folders,
test beds) must never touch what a live one still uses."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists in this PID namespace; another user's process counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
