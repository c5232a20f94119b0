"""Training-state checkpoints: what a restarted worker group needs to continue exactly where it stopped.

One directory per checkpoint, written by rank 0: ``state.pt`` (model, optimizer, schedule, step, counters)
and one stream position per rank (``stream_rankNNNN.pt``), because each rank reads different shards and a
resumed rank must continue its own stream rather than replay it.

Checkpoint directories are named after their step (``checkpoint_000000300``), so a worker can tell which of
two checkpoints is newer and find the one rank 0 recorded in MLflow (see ``WorkerLoop._restore``).

Rank 0 writes each checkpoint into a local staging directory first (:func:`staging_directory`), which Ray
uploads and deletes. A worker killed while an upload is pending (a stopped job, a lost peer) never deletes
its staging directory, so the next one on the node removes those of dead processes.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dmltrain.service.processes import pid_alive

STATE_FILE = "state.pt"
_DIR_PREFIX = "checkpoint_"
STAGING_PREFIX = "dmltrain-ckpt-"

log = logging.getLogger(__name__)


def checkpoint_dir_name(step: int) -> str:
    """The directory Ray Train stores the checkpoint of ``step`` in, under ``<storage_path>/<run.name>``."""
    return f"{_DIR_PREFIX}{step:09d}"


def checkpoint_dir_step(path: str) -> int | None:
    """The step of a checkpoint directory named by :func:`checkpoint_dir_name` (None for other names)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    digits = name.removeprefix(_DIR_PREFIX)
    return int(digits) if name.startswith(_DIR_PREFIX) and digits.isdigit() else None


def checkpoint_uri(storage_path: str, run_name: str, step: int) -> str:
    """Where the checkpoint of ``step`` lives: a local path or a URI (s3://...) like ``storage_path``."""
    from dmltrain.data.urls import join_url

    return join_url(join_url(storage_path, run_name), checkpoint_dir_name(step))


def sampler_file(rank: int) -> str:
    return f"stream_rank{rank:04d}.pt"


@dataclass
class TrainingState:
    """Everything replicated across ranks that a resumed run must restore."""

    step: int
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    counters: dict[str, float] = field(default_factory=dict)
    world_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def _filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow file system, path in it) of a local path or any URI pyarrow opens (s3://...)."""
    import pyarrow.fs

    from dmltrain.data.urls import is_local, local_path

    if is_local(uri):
        return pyarrow.fs.LocalFileSystem(), local_path(uri)
    return pyarrow.fs.FileSystem.from_uri(uri)


def _run_entries(storage_path: str, name: str) -> tuple[Any, list[Any]] | None:
    """(pyarrow file system, entries of ``storage_path/name``), or None when the storage cannot be listed
    (no credentials, an unknown scheme, the network)."""
    import pyarrow.fs

    try:
        filesystem, root = _filesystem(storage_path)
        selector = pyarrow.fs.FileSelector(f"{root.rstrip('/')}/{name}", allow_not_found=True)
        return filesystem, filesystem.get_file_info(selector)
    except Exception:
        return None


def count_ray_checkpoints(storage_path: str, name: str) -> int | None:
    """How many checkpoints Ray Train keeps for run ``name`` under ``storage_path`` (a local path or any
    URI pyarrow opens, e.g. s3://); None when the storage cannot be listed (the caller then falls back to
    MLflow's record)."""
    import pyarrow.fs

    listed = _run_entries(storage_path, name)
    if listed is None:
        return None
    return sum(
        1
        for info in listed[1]
        if info.type == pyarrow.fs.FileType.Directory and info.base_name.startswith("checkpoint_")
    )


def remove_checkpoints_except(storage_path: str, name: str, keep: set[int]) -> list[int]:
    """Delete run ``name``'s checkpoint directories whose step is not in ``keep``; returns the steps
    removed. Ray deletes only the checkpoints it registered: one stored while the driver was gone (rank 0
    finished it, Ray never heard) stayed forever, beyond run.keep_checkpoints. Nothing when the storage
    cannot be listed."""
    import pyarrow.fs

    listed = _run_entries(storage_path, name)
    if listed is None:
        return []
    filesystem, found = listed
    removed = []
    for info in found:
        step = checkpoint_dir_step(info.path) if info.type == pyarrow.fs.FileType.Directory else None
        if step is None or step in keep:
            continue
        try:  # a store that allows no deletes: the run still finished, its models are logged
            filesystem.delete_dir(info.path)
        except Exception as exc:
            log.warning("could not remove checkpoint %s (%s): left in storage, maybe in part", info.path, exc)
            continue
        removed.append(step)
    return sorted(removed)


def checkpoint_stored(uri: str) -> bool:
    """Whether the checkpoint at ``uri`` (`checkpoint_uri`: a local path or an s3://-style URI) holds its
    state file; False also when the storage cannot be asked."""
    import pyarrow.fs

    try:
        filesystem, path = _filesystem(uri)
        return filesystem.get_file_info(f"{path.rstrip('/')}/{STATE_FILE}").type == pyarrow.fs.FileType.File
    except Exception:  # no credentials, unknown scheme, network
        return False


def save_state(directory: str | os.PathLike[str], state: TrainingState) -> Path:
    path = Path(directory) / STATE_FILE
    torch.save(state.__dict__, path)
    return path


def load_state(directory: str | os.PathLike[str]) -> TrainingState:
    path = Path(directory) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {directory} has no {STATE_FILE}")
    return TrainingState(**torch.load(path, map_location="cpu", weights_only=True))


def save_stream_state(directory: str | os.PathLike[str], rank: int, state: dict[str, Any]) -> None:
    torch.save(state, Path(directory) / sampler_file(rank))


def load_stream_state(directory: str | os.PathLike[str], rank: int) -> dict[str, Any] | None:
    path = Path(directory) / sampler_file(rank)
    return torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None


def _staging_owner(name: str) -> tuple[int, str] | None:
    """(pid, host) of a staging directory named by :func:`staging_directory`; None for any other name."""
    if not name.startswith(STAGING_PREFIX) or "~" not in name:
        return None
    owner = name.removeprefix(STAGING_PREFIX).rpartition("~")[0]
    pid, _, host = owner.partition("@")
    return (int(pid), host) if pid.isdigit() and host else None


def remove_stale_staging(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Delete the staging directories under ``root`` (the temp dir) whose writer on this host has exited.

    Only directories named by this host's processes are considered: a /tmp shared across hosts (or PID
    namespaces with their own hostnames) keeps the others' directories."""
    host = socket.gethostname()
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{STAGING_PREFIX}*~*"):
        owner = _staging_owner(path.name)
        if owner is None or owner[1] != host or pid_alive(owner[0]) or not path.is_dir():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        log.info("removed %d checkpoint staging directories left by exited workers", len(removed))
    return removed


def staging_directory(root: str | os.PathLike[str] | None = None) -> str:
    """A new local directory for one checkpoint, named after this process and host (see the module doc)."""
    remove_stale_staging(root)
    return tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}@{socket.gethostname()}~", dir=root)
