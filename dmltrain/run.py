"""``python -m dmltrain.run CONFIG [key.sub=value ...]``: the service's public entry point.

The implementation lives in :mod:`dmltrain.service.run`; this module keeps the documented command
(`ray job submit -- python -m dmltrain.run ...`) stable while the service code stays in its own package.
"""

from __future__ import annotations

import sys

from dmltrain.service.run import RunOutcome, launch, main

__all__ = ["RunOutcome", "launch", "main"]

if __name__ == "__main__":
    sys.exit(main())
