"""The weights file inside every dmltrain model: ``{"model": state_dict, "config": resolved config, "step"}``.

Plain tensors and JSON-like values only, so ``torch.load(..., weights_only=True)`` reads it: loading a model
never unpickles arbitrary objects.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

WEIGHTS_FILE = "model.pt"


def save_weights(
    path: str | os.PathLike[str], state_dict: dict[str, Any], config: dict[str, Any], step: int
) -> Path:
    out = Path(path)
    torch.save({"model": state_dict, "config": config, "step": int(step)}, out)
    return out


def load_weights(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and check a weights file; the error names the file and what is wrong with it."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"model file not found: {file}")
    saved = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(saved, dict) or "model" not in saved or "config" not in saved:
        raise ValueError(f"{file} is not a dmltrain model file (expected keys 'model' and 'config')")
    return saved
