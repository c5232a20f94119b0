"""Reading a local weights file, whatever wrote it (clusters without internet load every backbone this way).

Accepted: a plain state dict (``.pt``/``.pth``/``.bin``, or ``.safetensors``), one nested under ``model``
or ``state_dict`` (dmltrain checkpoints, timm / Lightning training checkpoints), with DDP's ``module.`` or
torch.compile's ``_orig_mod.`` prefixes. A dmltrain embedding network (``backbone.*`` + ``embedding.*``)
is recognised so that it is loaded whole, head included.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dmltrain.models.common import check_weights_file

StateDict = dict[str, torch.Tensor]
_NESTED_KEYS = ("state_dict", "model")
_PREFIXES = ("module.", "_orig_mod.")


def read_state_dict(path: str | Path) -> StateDict:
    """The tensors of a weights file, unwrapped and with wrapper prefixes removed (on the CPU)."""
    file = check_weights_file(str(path))
    if file.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as exc:
            raise ImportError(
                f"model.weights={file}: reading .safetensors needs `pip install safetensors`"
            ) from exc
        state: object = load_file(str(file), device="cpu")
    else:
        state = _torch_load(file)
    for key in _NESTED_KEYS:
        if isinstance(state, dict) and isinstance(state.get(key), dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"model.weights={file}: expected a state dict of tensors")
    return {_strip(k): v for k, v in state.items()}


def _torch_load(file: Path) -> object:
    """torch.load, memory-mapped when the file allows it (zip format): big files are not copied into
    memory just to be matched against a model or copied into its parameters."""
    try:
        try:
            return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as exc:
            if "mmap" not in str(exc):
                raise
            return torch.load(file, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except Exception as exc:  # pickles with arbitrary objects, truncated files, not a torch file at all
        raise ValueError(
            f"model.weights={file}: not a loadable state dict ({type(exc).__name__}: {exc})"
        ) from exc


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key


def is_embedding_state(state: StateDict) -> bool:
    """A whole dmltrain EmbeddingNet (backbone and head), e.g. a finished run's model or a checkpoint."""
    return any(k.startswith("backbone.") for k in state) and any(k.startswith("embedding.") for k in state)


def load_matching(module: nn.Module, state: StateDict, source: str, ignore: tuple[str, ...] = ()) -> None:
    """Load ``state`` into ``module``: every tensor of the module must be there with its shape; extra
    entries are allowed only under the ``ignore`` prefixes (a classifier the embedding head replaces)."""
    own = module.state_dict()
    missing = sorted(k for k in own if k not in state)
    unexpected = sorted(k for k in state if k not in own and not k.startswith(ignore))
    wrong = sorted(k for k in own if k in state and state[k].shape != own[k].shape)
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors missing (e.g. {missing[:3]})")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})")
    if wrong:
        k = wrong[0]
        problems.append(
            f"{len(wrong)} of another shape (e.g. {k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)})"
        )
    if problems:
        raise ValueError(f"model.weights={source} does not fit this backbone: " + "; ".join(problems))
    module.load_state_dict({k: state[k] for k in own})
