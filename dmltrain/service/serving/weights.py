"""The weights file inside every dmltrain model: ``{"model": state_dict, "config": resolved config, "step",
"preprocess": the resolved test-time preprocessing (dmltrain.models.PreprocessConfig.to_dict())}``.

Plain tensors and JSON-like values only, so ``torch.load(..., weights_only=True)`` reads it: loading a model
never unpickles arbitrary objects.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

WEIGHTS_FILE = "model.pt"


def save_weights(
    path: str | os.PathLike[str],
    state_dict: dict[str, Any],
    config: dict[str, Any],
    step: int,
    preprocess: dict[str, Any] | None = None,
) -> Path:
    out = Path(path)
    payload = {"model": state_dict, "config": config, "step": int(step)}
    if preprocess is not None:
        payload["preprocess"] = preprocess
    torch.save(payload, out)
    return out


def weights_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a weights file: what an index records of the model it was built with. The training step
    alone told two runs of the same length apart from nothing (a rerun writing the same ``model.pt``)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_weights(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a weights file; the error names the file and what is wrong with it."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model file not found: {file}")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # UnpicklingError, RuntimeError, EOFError, KeyError... by the kind of damage
        # torch's own text for a non-checkpoint suggests weights_only=False, which is not the answer here;
        # a damaged archive's RuntimeError does say what is wrong.
        text = str(exc).strip()
        reason = type(exc).__name__ + (
            f": {text.splitlines()[0]}" if isinstance(exc, RuntimeError) and text else ""
        )
        raise ValueError(f"{file} is not a readable dmltrain model file ({reason})") from None
    if not isinstance(saved, dict) or "model" not in saved or "config" not in saved:
        raise ValueError(f"{file} is not a dmltrain model file (expected keys 'model' and 'config')")
    return saved
