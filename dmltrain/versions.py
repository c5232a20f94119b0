"""The software a run used, in one line: what a bug report or a reproduction needs first.

Versions come from the installed distributions' metadata, so reading them imports none of the packages
(`dmltrain --version` stays instant); where torch is already loaded, its CUDA, cuDNN and NCCL are added.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import dmltrain

# What the runs depend on, in the order a reader looks for them; absent ones are left out.
STACK = (
    "torch",
    "torchvision",
    "ray",
    "mlflow",
    "faiss-cpu",
    "faiss-gpu",
    "faiss-gpu-cu12",
    "faiss-gpu-cu11",
    "webdataset",
    "timm",
    "open_clip_torch",
    "numpy",
    "pillow",
)


def package_versions(names: Sequence[str] = STACK) -> dict[str, str]:
    """``{distribution: version}`` of those of ``names`` that are installed. torch and torchvision, when
    loaded, give their own ``__version__``, which keeps the build's local tag (``2.14.1+cu130``)."""
    found = {}
    for name in names:
        module = sys.modules.get(name) if name in ("torch", "torchvision") else None
        try:
            found[name] = str(getattr(module, "__version__", None) or metadata.version(name))
        except metadata.PackageNotFoundError:
            continue
    return found


def _cuda_stack() -> str:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return ""
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
    return f"; CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, NCCL {nccl}"


def version_line() -> str:
    """``dmltrain 0.1.0 (python 3.11.9; torch 2.14.1, ray 2.60.0, ...)``, with CUDA's where torch uses it."""
    stack = ", ".join(f"{name} {version}" for name, version in package_versions().items())
    return f"dmltrain {dmltrain.__version__} (python {platform.python_version()}; {stack}{_cuda_stack()})"


class VersionAction(argparse.Action):
    """``--version``: print `version_line` and exit (read only when asked, not at every parse)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print dmltrain's version and those of its stack, then exit")
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(version_line())
        parser.exit()
