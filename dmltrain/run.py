"""``python -m dmltrain.run CONFIG [key.sub=value ...]``: the service's public entry point.

The command line lives in :mod:`dmltrain.service.entry` and the launch in :mod:`dmltrain.service.run`; this
module keeps the documented command (`ray job submit -- python -m dmltrain.run ...`) stable while the
service code stays in its own package. ``launch`` and ``RunOutcome`` load on first use, so the command can
reject a config typo before torch, Ray and MLflow are imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dmltrain.service.entry import exit_process, main

if TYPE_CHECKING:
    from dmltrain.service.run import RunOutcome, launch

__all__ = ["RunOutcome", "launch", "main"]


def __getattr__(name: str) -> Any:
    if name in ("RunOutcome", "launch"):
        from dmltrain.service import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    exit_process(main())
