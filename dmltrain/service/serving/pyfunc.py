"""A trained dmltrain model as an MLflow pyfunc: images in, L2-normalised float32 embeddings out.

Input: a DataFrame (or dict) with an ``image`` column holding encoded JPEG/PNG/WebP bytes (base64 text over
REST) or uint8 H x W x C arrays of any size (MLflow's schema check passes the column through untouched; it
refuses a bare list or a 4-D array before the model sees it, so wrap images in a column). Output: one
float32 row of ``model.embedding_dim`` per image. Inside is exactly the run's test-time path
(``build_test_transform`` + ``dmltrain.inference.embed_batch``), so served embeddings equal the ones
evaluation measured. The model is logged "from code" with the dmltrain package beside it (``code_paths``),
so it loads where dmltrain is not installed, e.g. under ``mlflow models serve``.
"""

from __future__ import annotations

import io
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import BAD_REQUEST

from dmltrain.inference import ImageInputError, embed_images
from dmltrain.service.mlflow_scope import no_artifact_bars, tracking_uri
from dmltrain.service.serving.weights import WEIGHTS_FILE, load_weights

WEIGHTS_ARTIFACT = "weights"
# What one request may ask of a server: images per forward pass, pixels per image (a 519 KB PNG of 13,000 x
# 13,000 decoded to 507 MB; 50 MP holds a camera's full-size photo), neighbours per query.
MAX_BATCH_SIZE = 512
MAX_IMAGE_PIXELS = 50_000_000
MAX_K = 10_000
STEP_PARAM = "dmltrain.step"  # the logged model's training step, a param of the LoggedModel
_MODEL_CODE = Path(__file__).with_name("_model_code.py")
# What the pyfunc imports at load time (module -> distribution), pinned to the versions it was logged with.
_REQUIREMENTS = {
    "torch": "torch",
    "torchvision": "torchvision",
    "numpy": "numpy",
    "PIL": "pillow",
    "pandas": "pandas",
    "pydantic": "pydantic",
    "yaml": "pyyaml",
    "tqdm": "tqdm",
    "webdataset": "webdataset",
    "matplotlib": "matplotlib",
}
_BACKBONE_REQUIREMENTS = {"timm:": ["timm"], "open_clip:": ["open_clip_torch", "timm"]}


def _images(model_input: Any) -> list[Any]:
    """The images of any accepted input form, in order."""
    import pandas as pd

    if isinstance(model_input, pd.DataFrame):
        if "image" in model_input.columns:
            return list(model_input["image"])
        if len(model_input.columns) == 1:
            return list(model_input.iloc[:, 0])
        raise ImageInputError(f"expected an 'image' column, got columns {list(model_input.columns)}")
    if isinstance(model_input, dict):
        if "image" not in model_input:
            raise ImageInputError(f"expected an 'image' key, got {sorted(model_input)}")
        value = model_input["image"]
        return (
            list(value)
            if isinstance(value, list | tuple | np.ndarray) and not _is_one_array(value)
            else [value]
        )
    if isinstance(model_input, np.ndarray) and model_input.dtype == np.uint8:
        return list(model_input) if model_input.ndim == 4 else [model_input]
    if isinstance(model_input, bytes | str):
        return [model_input]
    return list(model_input)


def _is_one_array(value: Any) -> bool:
    return isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim in (2, 3)


class EmbeddingModel(mlflow.pyfunc.PythonModel):
    """Loads the weights artifact into the run's network; predicts embeddings with its test transform."""

    # The input is images in several forms (bytes, paths, uint8 arrays) that no type hint MLflow validates
    # describes; the stored signature (image: binary) and input example say what a client sends. Without
    # this MLflow warns at every import that predict has no type hints, through filters of its own that
    # a caller's warning filters cannot silence (MLflow's own flag, as its ChatModel sets).
    _skip_type_hint_validation = True

    def load_context(self, context: Any) -> None:
        from dmltrain.service.serving.loading import network_from_weights

        saved = load_weights(context.artifacts[WEIGHTS_ARTIFACT])
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.net, self.config, self.preprocessing = network_from_weights(saved, self.device)
        self.transform = self.preprocessing.test_transform()
        self.normalize = self.preprocessing.normalizer()

    # model_input is left unannotated: MLflow would otherwise try to derive a schema from the type hint.
    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        batch_size = request_param(params, "batch_size", 64, MAX_BATCH_SIZE)
        try:
            return embed_images(
                self.net,
                _images(model_input),
                self.transform,
                self.device,
                batch_size,
                self.normalize,
                max_pixels=MAX_IMAGE_PIXELS,
            )
        except ImageInputError as exc:
            raise BadRequestError(str(exc)) from exc


class BadRequestError(MlflowException, ValueError):
    """A request the model cannot answer (an unreadable image, k=0). MLflow's scoring server answers an
    MlflowException with its message (400 for BAD_REQUEST), any other error with a generic one that left
    ours only at the end of its stack trace; in a Python caller it is still a ValueError."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=BAD_REQUEST)


def request_param(params: dict[str, Any] | None, name: str, default: int, maximum: int) -> int:
    """An integer parameter of a request (``batch_size``, ``k``) in 1..``maximum``, or its default (also for
    null). Bounded: a client's k of 2**31 made faiss allocate for it and killed the server process."""
    raw = (params or {}).get(name)
    if raw is None:
        return default
    try:
        if isinstance(raw, bool):  # JSON true is no count
            raise ValueError
        value = int(raw)
        if value != raw and not (isinstance(raw, str) and raw.strip().lstrip("+-").isdigit()):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise BadRequestError(f"params: {name} must be an integer, got {raw!r}") from None
    if not 1 <= value <= maximum:
        raise BadRequestError(f"params: {name} must be from 1 to {maximum:,}, got {value}")
    return value


def pip_requirements(backbone: str) -> list[str]:
    """Pinned requirements of the served model (mlflow itself is added by MLflow)."""
    names = list(_REQUIREMENTS.values())
    for prefix, extra in _BACKBONE_REQUIREMENTS.items():
        if backbone.startswith(prefix):
            names += extra
    out = []
    for name in dict.fromkeys(names):
        try:
            version = metadata.version(name).split("+", 1)[0]  # torch 2.14.1+cu130 -> 2.14.1
            out.append(f"{name}=={version}")
        except metadata.PackageNotFoundError:
            out.append(name)
    return out


def _example_png(size: int) -> bytes:
    """A small deterministic colour-gradient PNG: the input example stored with the model."""
    from PIL import Image

    ramp = np.linspace(0, 255, size, dtype=np.uint8)
    rgb = np.stack(
        [np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size)), np.full((size, size), 128, np.uint8)],
        -1,
    )
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def signature(embedding_dim: int) -> Any:
    from mlflow.models import ModelSignature
    from mlflow.types import DataType
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema, TensorSpec

    return ModelSignature(
        inputs=Schema([ColSpec(DataType.binary, "image")]),
        outputs=Schema([TensorSpec(np.dtype(np.float32), (-1, embedding_dim))]),
        params=ParamSchema([ParamSpec("batch_size", DataType.long, 64)]),
    )


def _package_copy(directory: Path) -> Path:
    """The dmltrain package without caches, to ship as the model's code."""
    import dmltrain

    source = Path(dmltrain.__file__).parent
    target = directory / "dmltrain"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return target


@dataclass(frozen=True)
class PyfuncParts:
    """What a dmltrain pyfunc is made of, whether logged to a run or saved to a folder: the "model from
    code" file, its artifacts (name -> local path), signature, input example, pinned requirements."""

    code_file: Path
    artifacts: dict[str, str]
    signature: Any
    example: Any
    requirements: list[str]
    metadata: dict[str, Any]


def embedding_parts(weights_file: str | Path, step: int | None = None) -> PyfuncParts:
    """The embedding pyfunc of a weights file (see :mod:`.weights`); ``step`` defaults to the file's."""
    import pandas as pd

    saved = load_weights(weights_file)
    model_cfg, data_cfg = saved["config"]["model"], saved["config"]["data"]
    side = (
        (saved.get("preprocess") or {}).get("resize") or data_cfg.get("resize") or data_cfg.get("image_size")
    )
    step = int(saved.get("step") or 0) if step is None else step
    return PyfuncParts(
        code_file=_MODEL_CODE,
        artifacts={WEIGHTS_ARTIFACT: str(weights_file)},
        signature=signature(int(model_cfg["embedding_dim"])),
        example=pd.DataFrame({"image": [_example_png(int(side or 224))]}),
        requirements=pip_requirements(str(model_cfg["backbone"])),
        metadata={
            "dmltrain_weights_file": WEIGHTS_FILE,
            "dmltrain_step": step,
            "dmltrain_embedding_dim": int(model_cfg["embedding_dim"]),
        },
    )


def log_pyfunc(
    tracking: str,
    run_id: str,
    name: str,
    parts: PyfuncParts,
    *,
    step: int,
    tags: dict[str, str] | None = None,
) -> Any:
    """Log ``parts`` as the pyfunc ``name`` of ``run_id``; returns ModelInfo.

    ``runs:/<run_id>/<name>`` then resolves to it (the newest one when a relaunch logs it again)."""
    from mlflow.models import Model

    with tempfile.TemporaryDirectory() as tmp, tracking_uri(tracking), no_artifact_bars():
        code = _package_copy(Path(tmp))
        # Created here because Model.log without an active run files the model under the default
        # experiment, where `runs:/<run_id>/<name>` (which searches the run's experiment) cannot find it.
        client = mlflow.MlflowClient(tracking)
        logged = client.create_logged_model(
            experiment_id=client.get_run(run_id).info.experiment_id,
            name=name,
            source_run_id=run_id,
            tags=tags,
            params={STEP_PARAM: str(step)},
        )
        # mlflow.pyfunc.log_model logs to the active run only; Model.log (which it wraps) takes a run id.
        return Model.log(
            artifact_path=None,
            name=name,
            flavor=mlflow.pyfunc,
            run_id=run_id,
            step=step,
            model_id=logged.model_id,
            flavor_name="pyfunc.ModelFromCode",  # what mlflow.pyfunc.log_model passes for a code file
            **_model_arguments(parts, code),
        )


def save_pyfunc(path: str | Path, parts: PyfuncParts) -> Path:
    """Write ``parts`` as an MLflow model folder at ``path`` (which must not exist): what
    ``mlflow models serve -m <path>`` serves and ``mlflow.pyfunc.load_model`` loads, no store needed."""
    with tempfile.TemporaryDirectory() as tmp, no_artifact_bars():
        code = _package_copy(Path(tmp))
        mlflow.pyfunc.save_model(str(path), **_model_arguments(parts, code))
    return Path(path)


def _model_arguments(parts: PyfuncParts, code: Path) -> dict[str, Any]:
    """What logging and saving a pyfunc both pass to MLflow."""
    return {
        "python_model": str(parts.code_file),
        "artifacts": parts.artifacts,
        "code_paths": [str(code)],
        "signature": parts.signature,
        "input_example": parts.example,
        "pip_requirements": parts.requirements,
        "metadata": parts.metadata,
    }


def log_embedding_model(
    tracking: str,
    run_id: str,
    name: str,
    weights_file: str | Path,
    *,
    step: int,
    tags: dict[str, str] | None = None,
) -> Any:
    """Log ``weights_file`` (see :mod:`.weights`) as the embedding pyfunc ``name`` of ``run_id``."""
    parts = embedding_parts(weights_file, step)
    return log_pyfunc(tracking, run_id, name, parts, step=step, tags=tags)
