"""Training-state checkpoints: what a restarted worker group needs to continue exactly where it stopped.

One directory per checkpoint, written by rank 0: ``state.pt`` (model, optimizer, schedule, step, counters)
and one stream position per rank (``stream_rankNNNN.pt``), because each rank reads different shards and a
resumed rank must continue its own stream rather than replay it.

Checkpoint directories are named after their step (``checkpoint_000000300``), so a worker can tell which of
two checkpoints is newer and find the one rank 0 recorded in MLflow (see ``WorkerLoop._restore``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
_DIR_PREFIX = "checkpoint_"


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


def count_ray_checkpoints(storage_path: str, name: str) -> int | None:
    """How many checkpoints Ray Train keeps for run ``name`` under ``storage_path`` (a local path or any
    URI pyarrow opens, e.g. s3://); None when the storage cannot be listed."""
    import pyarrow.fs

    from dmltrain.data.urls import is_local, local_path

    try:
        if is_local(storage_path):
            filesystem, root = pyarrow.fs.LocalFileSystem(), local_path(storage_path)
        else:
            filesystem, root = pyarrow.fs.FileSystem.from_uri(storage_path)
        found = filesystem.get_file_info(
            pyarrow.fs.FileSelector(f"{root.rstrip('/')}/{name}", allow_not_found=True)
        )
    except Exception:  # no credentials, unknown scheme, network: the caller falls back to MLflow's record
        return None
    return sum(
        1
        for info in found
        if info.type == pyarrow.fs.FileType.Directory and info.base_name.startswith("checkpoint_")
    )


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
