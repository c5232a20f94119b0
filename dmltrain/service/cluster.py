"""Where a run's state may live when its workers are spread over several machines.

Ray Train places rank 0 (the MLflow writer) and the checkpoint writers on whichever nodes have room, so
everything the driver names by path must mean the same thing on every node. On a multi-node cluster the
driver therefore refuses, before any worker starts and with one line per setting:

- ``mlflow.tracking_uri`` (or ``$MLFLOW_TRACKING_URI``, or the ``sqlite:///<cwd>/mlflow.db`` default) that
  is a file (``sqlite:``, ``file:``, a plain path) or a server on the driver's loopback interface: use an
  MLflow server (``http(s)://``) or a database URL that every node reaches;
- a relative ``run.storage_path``, ``data.root`` or ``model.weights``: it names the driver's working
  directory, which other nodes do not have (under ``ray job submit`` it is even a temporary copy);
- an absolute local path that another node does not see: a mount cannot be known to be shared by
  looking at it, so the driver *checks*: it writes a token under ``run.storage_path`` and a tiny Ray task
  on every other alive node reads it back, and compares ``data.root/dataset.json`` and the
  ``model.weights`` file with the driver's. Nodes that join later (autoscaling) cannot be checked; the
  rule for them is the documented assumption that absolute paths are shared mounts.

"Multi-node" is decided from the cluster the driver connected to (:func:`decide_topology`).
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from dmltrain.data.urls import is_local, local_path
from dmltrain.service.config import ConfigError, ExperimentConfig

log = logging.getLogger("dmltrain.service.cluster")

_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "ip6-localhost"}
_FILE_SCHEMES = {"", "file", "sqlite"}
PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node, as ``ray.nodes()`` describes it."""

    node_id: str
    address: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class ClusterView:
    """What the driver knows about the cluster before it starts any worker."""

    nodes: tuple[NodeInfo, ...]
    attached: bool  # joined an existing cluster (RAY_ADDRESS, which `ray job submit` sets for its driver)
    driver_node_id: str | None = None

    @classmethod
    def from_ray_nodes(
        cls, nodes: Sequence[Mapping[str, Any]], attached: bool, driver_node_id: str | None = None
    ) -> ClusterView:
        """Build from ``ray.nodes()`` output; dead nodes (a replaced or lost machine) are left out."""
        alive = tuple(
            NodeInfo(
                node_id=str(node.get("NodeID", "")),
                address=str(node.get("NodeManagerAddress", "?")),
                cpus=float((node.get("Resources") or {}).get("CPU", 0.0)),
                gpus=float((node.get("Resources") or {}).get("GPU", 0.0)),
            )
            for node in nodes
            if node.get("Alive", node.get("alive", False))
        )
        return cls(alive, attached, driver_node_id)

    @property
    def gpus(self) -> float:
        return sum(node.gpus for node in self.nodes)


@dataclass(frozen=True)
class Topology:
    multi_node: bool
    reason: str  # why, for messages: "2 alive Ray nodes", "scaling.topology=single-node", ...


def joins_existing_cluster(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``ray.init`` will join a running cluster instead of starting one on this machine.

    ``ray job submit`` runs the driver with RAY_ADDRESS set to the head, so this covers submitted jobs too.
    """
    env = os.environ if environ is None else environ
    return bool(env.get("RAY_ADDRESS"))


def decide_topology(setting: str, view: ClusterView) -> Topology:
    """Is this run spread over several machines? ``setting`` is ``scaling.topology``.

    auto: multi-node when Ray reports more than one alive node, when no alive node has CPUs (the head of
    an autoscaling cluster, started with ``--num-cpus 0``: workers will run on nodes still to come), or
    when the driver joined an existing cluster (it may grow, and a submitted job's working directory is a
    temporary copy). ``single-node`` waives the last two only: it cannot hide a second alive node.
    """
    alive = len(view.nodes)
    if setting == "multi-node":
        return Topology(True, "scaling.topology=multi-node")
    if alive > 1:
        if setting == "single-node":
            raise ConfigError(
                f"scaling.topology=single-node, but Ray reports {alive} alive nodes "
                f"({', '.join(n.address for n in view.nodes)}): set scaling.topology=auto"
            )
        return Topology(True, f"{alive} alive Ray nodes")
    if setting == "single-node":
        return Topology(False, "scaling.topology=single-node")
    if view.nodes and all(node.cpus <= 0 for node in view.nodes):
        return Topology(True, "the only Ray node has no CPUs, so workers start on nodes yet to join")
    if view.attached:
        return Topology(
            True,
            "the driver joined an existing Ray cluster (RAY_ADDRESS); "
            "scaling.topology=single-node if it is one machine",
        )
    return Topology(False, "one local Ray node")


def placement_shortfall(config: ExperimentConfig, view: ClusterView) -> str | None:
    """One line when the nodes an attached cluster has now cannot host every worker, else None.

    Not refused: an autoscaler may add nodes (Ray Train waits for them). But on a fixed cluster the worker
    group never starts and Ray Train retries it without end (e.g. 8 workers of 12 CPUs on two 32-CPU
    pods fit 4), so the driver says so once, with the numbers."""
    if not view.attached or not view.nodes:
        return None
    scaling = config.scaling
    gpu = _gpu_workers(scaling.use_gpu, view.gpus)
    per_cpu = scaling.cpus_per_worker

    def fits(node: NodeInfo) -> int:
        by_cpu = int(node.cpus // per_cpu) if per_cpu > 0 else scaling.num_workers
        return min(by_cpu, int(node.gpus)) if gpu else by_cpu

    fit = sum(fits(node) for node in view.nodes)
    if fit >= scaling.num_workers:
        return None
    each = f"{per_cpu:g} CPUs{' + 1 GPU' if gpu else ''}"
    largest = max(view.nodes, key=lambda node: (node.gpus, node.cpus) if gpu else (node.cpus, node.gpus))
    return (
        f"the cluster's {len(view.nodes)} nodes now fit {fit} of scaling.num_workers={scaling.num_workers} "
        f"workers of {each} each (its largest node: {largest.cpus:g} CPUs, {largest.gpus:g} GPUs): Ray Train "
        "waits for nodes to join, and retries without end on a cluster that does not grow; lower "
        "scaling.cpus_per_worker or scaling.num_workers to fit it"
    )


def local_capacity_problem(
    config: ExperimentConfig,
    view: ClusterView,
    machine_cpus: int,
    machine_gpus: int | None = None,
    driver_cpus: float = 0.0,
) -> str | None:
    """One line when the workers ask for more CPUs (or GPUs: ``scaling.use_gpu=true``, or ``auto`` on a
    cluster with a GPU, which the run would then train on) than a single-node cluster has, else None.

    Ray would otherwise wait for resources that never come. Only a cluster that cannot grow is checked:
    the local one this driver starts (this machine's CPUs and GPUs; `machine_gpus` None: not counted) or an
    in-process one; an attached cluster may autoscale, so its current nodes say nothing about what fits.
    ``driver_cpus``: what the process driving the workers holds besides them (a sweep's Tune trial).
    """
    if view.attached:
        return None
    scaling = config.scaling
    cpus = sum(node.cpus for node in view.nodes) if view.nodes else float(machine_cpus)
    need = scaling.num_workers * scaling.cpus_per_worker
    if need + driver_cpus > cpus:
        driver = f" + {driver_cpus:g} for the trial's driver (trial_resources)" if driver_cpus else ""
        return (
            f"scaling.num_workers={scaling.num_workers} x scaling.cpus_per_worker="
            f"{scaling.cpus_per_worker:g} = {need:g} CPUs{driver}, but the single-node Ray cluster of this "
            f"run has {cpus:g}: lower scaling.cpus_per_worker (torch threads follow it unless "
            "scaling.torch_threads is set) or scaling.num_workers"
        )
    gpus = view.gpus if view.nodes else machine_gpus
    if config.data.decode == "gpu" and gpus is not None and gpus < 1:  # found only after Ray started
        return (
            "data.decode=gpu decodes on the training workers' GPUs, but the single-node Ray cluster of this "
            "run has none: set data.decode=auto or cpu"
        )
    if gpus is None or scaling.num_workers <= gpus:
        return None
    if scaling.use_gpu is True and gpus < 1:
        return (
            f"scaling.use_gpu=true gives each of scaling.num_workers={scaling.num_workers} a GPU, but the "
            f"single-node Ray cluster of this run has {gpus:g}: set scaling.use_gpu=auto (CPU where there "
            "is no GPU) or false"
        )
    if _gpu_workers(scaling.use_gpu, gpus):  # auto: GPUs, as the run would
        return (
            f"scaling.use_gpu={str(scaling.use_gpu).lower()} gives each of scaling.num_workers="
            f"{scaling.num_workers} a GPU, but the single-node Ray cluster of this run has {gpus:g}: set "
            f"scaling.num_workers={int(gpus)} (the global batch stays train.global_batch_size) or "
            "scaling.use_gpu=false"
        )
    return None


def _tracking_problem(uri: str) -> str | None:
    if uri.split(":", 1)[0].lower() in {"databricks", "databricks-uc"}:  # MLflow's hosted stores
        return None
    parsed = urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in _FILE_SCHEMES or len(scheme) == 1:  # one letter: a Windows drive
        return "is a file on the driver's node, which rank 0 on another node cannot open"
    host = (parsed.hostname or "").lower().rstrip(".")
    # /etc/hosts names of this machine, and *.localhost, which resolvers answer with loopback (RFC 6761)
    names = {"localhost.localdomain", "localhost6", "localhost6.localdomain6", "ip6-loopback"}
    if host in _LOOPBACK or host in names or host.endswith(".localhost") or _is_loopback_address(host):
        return "is a server on the driver's loopback interface, which other nodes cannot reach"
    if not host and "://" in uri:  # postgresql:///db?host=/var/run/postgresql: a socket on this node
        return "names no host (a local socket on the driver's node), which other nodes cannot reach"
    return None


def _is_loopback_address(host: str) -> bool:
    """127.0.0.0/8 (Debian's 127.0.1.1 hostname alias too) in every spelling the C resolver takes (127.1,
    2130706433, 0x7f.1: inet_aton's forms), ::1 in any spelling, IPv4-mapped ::ffff:127.x.x.x, and the
    unspecified address (0.0.0.0, 0, ::), which a client connects to as this machine."""
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.IPv4Address(socket.inet_aton(host))
        except (OSError, ValueError):  # not an address: a name
            return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


def _path_problem(value: str | None) -> str | None:
    if value is None or not is_local(value):
        return None
    path = local_path(value)
    if path.startswith("~"):  # checked before resolve_paths, which expands ~ as a shell would
        return "is under the driver's home directory (~), which other nodes may not share"
    if not Path(path).is_absolute():
        return "is relative to the driver's working directory, which other nodes do not see"
    return None


def storage_problems(
    config: ExperimentConfig, tracking_uri: str, tracking_is_default: bool, topology: Topology
) -> list[str]:
    """One line per setting that cannot work on a multi-node cluster; ``config`` as the user wrote it
    (before relative paths are made absolute). Empty on a single node."""
    if not topology.multi_node:
        return []
    where = f"on this multi-node cluster ({topology.reason})"
    problems = []
    tracking = _tracking_problem(tracking_uri)
    if tracking:
        source = (
            " (the default: neither mlflow.tracking_uri nor MLFLOW_TRACKING_URI is set)"
            if tracking_is_default
            else ""
        )
        problems.append(
            f"mlflow.tracking_uri={tracking_uri}{source} {tracking} {where}: set MLFLOW_TRACKING_URI or "
            f"mlflow.tracking_uri to an MLflow server (http(s)://host:5000) or a database URL "
            f"(postgresql://...) that every node reaches"
        )
    advice = {
        "run.storage_path": "an absolute path on a mount every node shares (e.g. /mnt/shared/ray-results) "
        "or an s3:// URI",
        "data.root": "an absolute path on a mount every node shares (e.g. /mnt/shared/shards/<dataset>) "
        "or an s3:// URI",
        "model.weights": "an absolute path on a mount every node shares, or a torchvision weights name",
    }
    weights = config.model.weights
    values = {
        "run.storage_path": config.run.storage_path,
        "data.root": config.data.root,
        "model.weights": weights if weights and ("/" in weights or Path(weights).is_file()) else None,
    }
    for key, value in values.items():
        problem = _path_problem(value)
        if problem:
            problems.append(f"{key}={value} {problem} {where}: set {key} to {advice[key]}")
    return problems


# ----------------------------------------------------------------------------------------------------------
# Checking that absolute paths are shared: a token file and digests, read back on every other node
# ----------------------------------------------------------------------------------------------------------

_DIGEST_LIMIT = 64 << 20  # hash files up to 64 MiB; larger ones (weights) are compared by size


def file_fingerprint(path: str) -> str | None:
    """``size:sha256`` of a file (size only above 64 MiB), or None when it cannot be read."""
    try:
        size = os.path.getsize(path)
        if size > _DIGEST_LIMIT:
            return f"{size}"
        with open(path, "rb") as handle:
            return f"{size}:{hashlib.sha256(handle.read()).hexdigest()}"
    except OSError:
        return None


def _fingerprints(paths: list[str]) -> list[str | None]:
    """Runs as a Ray task on another node: what that node sees at each path."""
    return [file_fingerprint(path) for path in paths]


@dataclass(frozen=True)
class _SharedCheck:
    key: str
    value: str
    path: str  # the file each node must see
    expected: str
    remedy: str = ""  # what to do instead; default: a shared mount or an s3:// URI for `key`


def _write_marker(folder: Path) -> Path:
    """A token file in ``folder`` (created), for other nodes to find; the caller removes it."""
    marker = folder / f".dmltrain-shared-check-{uuid.uuid4().hex}"
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(marker.name)
    return marker


def check_shared_paths(
    config: ExperimentConfig, view: ClusterView, artifact_root: str | None = None
) -> list[str]:
    """Absolute local paths in ``config`` (already resolved) that some other alive node does not see as the
    driver does; one line each, naming the node. URLs (s3://, https://) are not checked.

    ``artifact_root``: the MLflow experiment's artifact location (`experiment_artifact_root`). When it is a
    local path, rank 0 writes plots, checkpoints and models there on whichever node it runs on; a path only
    the driver's node has loses them without an error."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    checks: list[_SharedCheck] = []
    problems: list[str] = []
    markers: list[Path] = []

    def written_by_the_driver(key: str, value: str, folder: str, remedy: str = "") -> None:
        """A token file the driver writes in ``folder``, for every other node to find."""
        try:
            markers.append(_write_marker(Path(local_path(folder))))
        except OSError as exc:
            problems.append(f"{key}={value}: the driver cannot write there ({exc})")
        else:
            marker = str(markers[-1])
            checks.append(_SharedCheck(key, value, marker, file_fingerprint(marker) or "", remedy))

    storage = config.run.storage_path
    if is_local(storage):
        written_by_the_driver("run.storage_path", storage, storage)
    if artifact_root is not None and is_local(artifact_root):
        written_by_the_driver(
            "mlflow.experiment",
            f"{config.mlflow.experiment} (artifacts at {artifact_root})",
            artifact_root,
            "use an experiment whose artifact location every node shares (an s3:// URI, a shared mount), or "
            "an MLflow server that proxies artifacts (mlflow server --serve-artifacts)",
        )
    if is_local(config.data.root):
        dataset_json = os.path.join(local_path(config.data.root), "dataset.json")
        expected = file_fingerprint(dataset_json)
        if expected is not None:
            checks.append(_SharedCheck("data.root", config.data.root, dataset_json, expected))
    weights = config.model.weights
    if weights and os.path.isabs(weights) and (expected := file_fingerprint(weights)) is not None:
        checks.append(_SharedCheck("model.weights", weights, weights, expected))
    others = [node for node in view.nodes if node.node_id != view.driver_node_id]
    try:
        if not checks or not others:
            return problems
        probe = ray.remote(num_cpus=0, max_retries=0)(_fingerprints)
        paths = [check.path for check in checks]
        refs = [
            probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            ).remote(paths)
            for node in others
        ]
        try:
            seen = ray.get(refs, timeout=PROBE_TIMEOUT_S)
        except Exception as exc:  # a node that cannot run a task in time: do not block the run on it
            log.warning("could not check shared paths on every node (%s); assuming they are shared", exc)
            return problems
        for node, found in zip(others, seen, strict=True):
            for check, fingerprint in zip(checks, found, strict=True):
                if fingerprint != check.expected:
                    what = "does not exist" if fingerprint is None else "differs from the driver's"
                    remedy = check.remedy or (
                        f"set {check.key} to a path on a mount every node shares, or an s3:// URI"
                    )
                    problems.append(
                        f"{check.key}={check.value} is not shared: on node {node.address} {check.path} "
                        f"{what} (written/read on the driver's node): {remedy}"
                    )
        return problems
    finally:
        for marker in markers:
            marker.unlink(missing_ok=True)


def _gpu_workers(setting: bool | str, view_gpus: float) -> bool:
    """Whether workers take a GPU: ``scaling.use_gpu``, with ``auto`` as the GPUs the cluster has now."""
    return view_gpus >= 1 if setting == "auto" else bool(setting)


def resolve_use_gpu(setting: bool | str, view_gpus: float, topology: Topology) -> tuple[bool, str | None]:
    """``scaling.use_gpu`` -> (use GPUs?, a warning to log loudly or None).

    ``auto`` is decided from the GPUs the cluster has *now*: on an autoscaling cluster whose GPU nodes are
    not up yet that means CPU, so ``auto`` resolving to CPU on a multi-node cluster is worth a warning.
    """
    use_gpu = _gpu_workers(setting, view_gpus)
    if setting == "auto" and not use_gpu and topology.multi_node:
        return False, (
            f"scaling.use_gpu=auto resolved to CPU: the cluster has no GPU now ({topology.reason}). On "
            f"an autoscaling cluster whose GPU nodes are not up yet this trains on CPU; set "
            f"scaling.use_gpu=true to wait for GPUs, or scaling.use_gpu=false to silence this"
        )
    return use_gpu, None
