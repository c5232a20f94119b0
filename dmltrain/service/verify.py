"""``dmltrain verify``: a trained model on an IJB-C-style 1:1 verification protocol, in one process.

The template file names images relative to an image root; each goes through the model's own test-time path
(`dmltrain.inference`: decode, the run's resize/crop, its normalisation), and `dmltrain.verification` turns
the embeddings into template features and TAR at FAR. A missing image is an error naming it: a protocol
with holes is not the protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from dmltrain.inference import embed_images, image_tensor
from dmltrain.service.serving.loading import load_embedding_model
from dmltrain.verification import DEFAULT_FARS, load_verification_protocol, verification_metrics


def _images(root: Path, names: list[str], listed_in: str) -> Iterator[np.ndarray]:
    """Decoded uint8 (H, W, 3) images; an unreadable one is an error naming its file."""
    for name in names:
        path = root / name
        if not path.is_file():
            raise FileNotFoundError(f"{path} (listed in {listed_in}) does not exist")
        yield image_tensor(path.read_bytes(), f"{path} (listed in {listed_in})").permute(1, 2, 0).numpy()


def verify_saved_model(
    model: str | Path,
    template_file: str | Path,
    pair_file: str | Path,
    image_root: str | Path,
    batch_size: int = 128,
    fars: Sequence[float] = DEFAULT_FARS,
    *,
    tracking_uri: str | None = None,
) -> dict[str, float]:
    """TAR at each FAR of ``model`` (a model.pt, MLflow model folder, runs:/ or models:/) on the protocol
    (file formats: dmltrain.verification)."""
    protocol = load_verification_protocol(template_file, pair_file)
    loaded = load_embedding_model(str(model), tracking_uri)
    images = _images(Path(image_root), protocol.images, str(template_file))
    embeddings = embed_images(
        loaded.net,
        images,
        loaded.transform,
        loaded.device,
        batch_size,
        normalize=loaded.preprocessing.normalizer(),
    )
    return verification_metrics(embeddings, protocol, fars)
