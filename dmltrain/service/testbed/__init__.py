"""A real multi-node Ray deployment on one Linux machine, for tests and for trying the cluster path by hand.

Each Ray node runs in its own network namespace (own IP on a bridge the bed creates) and its own mount
namespace (its own ``/tmp`` and node-local disk, the other nodes' disks hidden); one shared directory is
visible to all at the same path, as a ReadWriteMany volume would be. The head (0 CPUs, as ``cluster/``
ships it) also hosts an MLflow server on PostgreSQL with proxied artifacts and an S3 endpoint (moto).
Jobs are submitted from the root namespace with ``ray job submit`` and token auth. Needs root and
``ip``/``unshare``; ``python -m dmltrain.service.testbed [--workers N] [--cpus N]`` starts one to play with
(Ctrl-C tears it down).
"""

from dmltrain.service.testbed.bed import BedError, Node, TestBed, bed_requirements
from dmltrain.service.testbed.netns import NetError

__all__ = ["BedError", "NetError", "Node", "TestBed", "bed_requirements"]
