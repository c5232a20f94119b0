"""``python -m dmltrain.service.testbed [--workers N] [--cpus N]``: start a test bed, say how to use it.

Ctrl-C tears it down.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from types import FrameType

from dmltrain.service.testbed.bed import BedError, TestBed, bed_requirements


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dmltrain.service.testbed", description=__doc__)
    parser.add_argument("--workers", type=int, default=2, help="worker nodes beside the 0-CPU head")
    parser.add_argument("--cpus", type=int, default=1, help="CPUs each worker node offers Ray")
    args = parser.parse_args(argv)
    why = bed_requirements()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` tears down like Ctrl-C, also while starting
    bed = TestBed(worker_nodes=args.workers, cpus_per_node=args.cpus)
    status = 0
    try:
        with bed:
            print(bed.describe(), flush=True)
            print("Ctrl-C tears everything down.", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except BedError as error:  # NetError (an `ip` command failed) too
        print(f"error: {error}", file=sys.stderr)
        status = 1
    left = bed.leftovers()  # after a failed start too: what the teardown could not remove
    if left:
        print(f"error: left behind: {left}", file=sys.stderr)
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
