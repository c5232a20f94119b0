"""Find a trained model by reference and rebuild its network: a local ``model.pt``, a local MLflow model
directory, ``runs:/<run_id>/<name>`` or ``models:/<name>/<version|@alias>`` (registry) or
``models:/<model_id>``. The network and its test transform come from the config saved with the weights.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dmltrain.data.transforms import Transform
from dmltrain.models import EmbeddingNet, PreprocessConfig
from dmltrain.service.config import ExperimentConfig
from dmltrain.service.serving.weights import WEIGHTS_FILE, load_weights, weights_digest

MLMODEL = "MLmodel"


@dataclass
class LoadedModel:
    """A model ready to embed: network (eval mode, on ``device``), its run config and where it came from."""

    net: EmbeddingNet
    config: ExperimentConfig
    transform: Transform
    preprocessing: PreprocessConfig  # the run's test-time resize/crop, mean/std, interpolation
    device: torch.device
    source: str  # the reference as given (local paths made absolute)
    run_id: str | None  # the MLflow run that logged it, if known
    step: int | None
    digest: str | None = None  # sha256 of the weights file (`weights_digest`)


def default_decode_workers(model: LoadedModel, batch_size: int) -> int:
    """Loader processes for embedding a whole split outside training (`dmltrain index`, `dmltrain
    evaluate`): none on a CPU, where the network's forward pass sets the pace (on 2 cores the glyph test
    split embedded in 8.0 s with none, 8.1 s with 1, 8.4 s with 2), and on a GPU all host cores but this
    process's, at most 8 (one process decoding with PIL gives a few hundred images a second), and no
    more than the free /dev/shm holds batches for (a container's is often 64 MB)."""
    from dmltrain.data.pools import available_cpus
    from dmltrain.data.shared_memory import eval_loader_bytes, shared_memory_size

    if model.device.type == "cpu":
        return 0
    workers = max(0, available_cpus(9) - 1)
    shm = shared_memory_size()
    side = model.preprocessing.resolution
    while workers and shm is not None and eval_loader_bytes(batch_size, workers, side) > shm[1]:
        workers -= 1
    return workers


def is_mlflow_uri(ref: str) -> bool:
    return ref.startswith(("runs:/", "models:/"))


def network_from_weights(
    saved: dict[str, Any], device: torch.device
) -> tuple[EmbeddingNet, ExperimentConfig, PreprocessConfig]:
    """Rebuild the network of a weights file (architecture only, then its state dict) and its test-time
    preprocessing: the one stored with the weights (``preprocess``), else resolved from the config."""
    from dmltrain.service.builders import build_network, resolve_preprocessing

    config = ExperimentConfig.model_validate(saved["config"])
    stored = saved.get("preprocess")
    preprocessing = PreprocessConfig.from_dict(stored) if stored else resolve_preprocessing(config)
    net = build_network(config, preprocessing, pretrained=False)
    net.load_state_dict(saved["model"])
    net.to(device).eval()
    return net, config, preprocessing


def _weights_in(directory: Path) -> Path:
    """The weights file of an MLflow model directory (``artifacts/model.pt``) or of a plain folder."""
    for candidate in (directory / "artifacts" / WEIGHTS_FILE, directory / WEIGHTS_FILE):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{directory} holds no dmltrain model ({WEIGHTS_FILE} not found)")


def _run_id_of(directory: Path) -> str | None:
    if not (directory / MLMODEL).is_file():
        return None
    from mlflow.models import Model

    return Model.load(str(directory / MLMODEL)).run_id


_DOWNLOAD_PREFIX = "dmltrain-model-"
_DOWNLOADS: list[str] = []


def _remove_downloads() -> None:
    for directory in _DOWNLOADS:
        shutil.rmtree(directory, ignore_errors=True)


def _download_dir() -> str:
    """A folder for one model download, removed when the process exits. MLflow's default download folder
    is never removed, so every `dmltrain evaluate/index/serve` (and every test) left a copy of the
    model's weights in the temp dir."""
    directory = tempfile.mkdtemp(prefix=_DOWNLOAD_PREFIX)
    if not _DOWNLOADS:
        atexit.register(_remove_downloads)
    _DOWNLOADS.append(directory)
    return directory


def _download(ref: str, tracking_uri: str | None, directory: str) -> Path:
    import mlflow
    from mlflow.exceptions import MlflowException

    from dmltrain.service.mlflow_scope import is_local_store, no_artifact_bars
    from dmltrain.service.mlflow_scope import tracking_uri as tracking_uri_block
    from dmltrain.service.tracking import resolve_tracking_uri, sqlite_store_path

    uri = resolve_tracking_uri(tracking_uri)
    store = sqlite_store_path(uri)
    if store is not None and not store.is_file():
        # MLflow would create an empty store there and then report the run as unknown.
        raise FileNotFoundError(
            f"{ref}: no MLflow store at {store} (run from the folder that holds it, or give --tracking-uri "
            "or $MLFLOW_TRACKING_URI)"
        )
    if store is None:
        # MLflow's client retries a server that refuses or does not answer for minutes, silently.
        from dmltrain.service.preflight import tracking_problem

        problem = tracking_problem(uri)
        if problem:
            raise ConnectionError(f"{ref}: the MLflow store at {uri} cannot be used: {problem}")
    try:
        # The logged-model lookup behind runs:/ reads the process-wide URI, not the argument.
        with tracking_uri_block(uri), no_artifact_bars(is_local_store(uri)):
            return Path(
                mlflow.artifacts.download_artifacts(artifact_uri=ref, tracking_uri=uri, dst_path=directory)
            )
    except MlflowException as exc:
        raise FileNotFoundError(f"{ref}: not found in the MLflow store at {uri} ({exc.message})") from None


def _local(ref: str) -> tuple[Path, str | None]:
    path = Path(ref).expanduser()
    if path.is_dir():
        return _weights_in(path), _run_id_of(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"model not found: {ref} (a model.pt, an MLflow model folder, runs:/ or models:/)"
        )
    return path, None


def locate(ref: str, tracking_uri: str | None = None) -> tuple[Path, str | None]:
    """``(weights file, run id)`` of a model reference; MLflow models are downloaded to a temporary folder
    that lives as long as this process."""
    if not is_mlflow_uri(ref):
        return _local(ref)
    local = _download(ref, tracking_uri, _download_dir())
    return _weights_in(local), _run_id_of(local)


@contextmanager
def located(ref: str, tracking_uri: str | None = None) -> Iterator[tuple[Path, str | None]]:
    """:func:`locate` for a caller that reads the weights at once: an MLflow download is removed when the
    block ends, not at exit, so a long-lived process (a server, a sweep, a test session) that loads many
    models keeps none of their files."""
    if not is_mlflow_uri(ref):
        yield _local(ref)
        return
    with downloaded(ref, tracking_uri) as local:
        yield _weights_in(local), _run_id_of(local)


@contextmanager
def downloaded(ref: str, tracking_uri: str | None = None) -> Iterator[Path]:
    """An MLflow artifact (``runs:/`` or ``models:/``) in a temporary folder removed when the block ends;
    FileNotFoundError naming the reference and the store when it is not there."""
    directory = tempfile.mkdtemp(prefix=_DOWNLOAD_PREFIX)
    try:
        yield _download(ref, tracking_uri, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def load_embedding_model(
    ref: str, tracking_uri: str | None = None, device: torch.device | None = None
) -> LoadedModel:
    """Load a model by reference (see module docstring) onto ``device`` (default: CUDA when available)."""
    with located(ref, tracking_uri) as (weights, run_id):
        return model_from_weights(weights, ref, run_id, device)


def model_from_weights(
    weights: Path, ref: str, run_id: str | None, device: torch.device | None = None
) -> LoadedModel:
    """The model of a weights file already at hand (``located``), recorded as coming from ``ref``: a caller
    that needs the file again (the search model logs it) downloads it once."""
    saved = load_weights(weights)
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    net, config, preprocessing = network_from_weights(saved, device)
    source = ref if is_mlflow_uri(ref) else str(Path(ref).expanduser().resolve())
    step = saved.get("step")
    return LoadedModel(
        net,
        config,
        preprocessing.test_transform(),
        preprocessing,
        device,
        source,
        run_id,
        None if step is None else int(step),
        weights_digest(weights),
    )
