"""Images in, embeddings out, with the test-time path evaluation uses: decode, test transform, normalise,
forward in eval mode. The served model (MLflow pyfunc), `dmltrain index` and evaluation all embed through
:func:`embed_batch`, so a served embedding equals the one evaluation measured.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

from dmltrain.data.errors import decode_failure
from dmltrain.data.transforms import Transform, decode, flatten, resized_pixels
from dmltrain.models import normalize_images

__all__ = ["ImageInputError", "embed_batch", "embed_images", "image_tensor"]


class ImageInputError(ValueError):
    """An input image that cannot be read; the message names it (``image 3: ...``), so a server can hand
    it back to its client as the request's fault."""


def image_tensor(image: Any, what: str = "image", max_pixels: int | None = None) -> torch.Tensor:
    """One image as uint8 (3, H, W) RGB: encoded JPEG/PNG/WebP bytes (or their base64 text, as JSON carries
    them, line breaks allowed), or a uint8 array (H, W, C) with C in 1, 3, 4 or (H, W). An array is what
    its PNG would decode to (`transforms.flatten`): RGBA composited onto white, grey repeated.
    ``max_pixels``: larger images are refused before they are decoded (a server's guard against a small
    file that decodes to gigabytes)."""
    if isinstance(image, str):
        image = _from_base64(image.encode("ascii", "replace"))
        if image is None:
            raise ImageInputError(f"{what}: a string must be base64-encoded image bytes")
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        size = _header_size(data, what, max_pixels)
        # no image PIL knows: base64 text that arrived as bytes (MLflow's inputs / instances)
        if size is None:
            decoded = _from_base64(data)
            if decoded:
                data, size = decoded, _header_size(decoded, what, max_pixels)
        if max_pixels is not None and size is not None and size[0] * size[1] > max_pixels:
            raise ImageInputError(f"{what}: {size[0]}x{size[1]} pixels, over the limit of {max_pixels:,}")
        try:
            return decode(data)
        except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError...
            raise ImageInputError(f"{what}: cannot decode the image bytes ({decode_failure(exc)})") from exc
    a = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if a.dtype != np.uint8:
        raise ImageInputError(f"{what}: arrays must be uint8 (H, W, C), got dtype {a.dtype}")
    if a.ndim == 2:
        a = a[:, :, None]
    if a.ndim != 3 or a.shape[2] not in (1, 3, 4) or min(a.shape[:2]) < 1:
        raise ImageInputError(f"{what}: expected a (H, W, C) array with C in 1, 3 or 4, got shape {a.shape}")
    if max_pixels is not None and a.shape[0] * a.shape[1] > max_pixels:
        raise ImageInputError(f"{what}: {a.shape[1]}x{a.shape[0]} pixels, over the limit of {max_pixels:,}")
    if a.shape[2] == 4:
        a = np.asarray(flatten(Image.fromarray(np.ascontiguousarray(a), "RGBA")))
    a = np.repeat(a, 3, axis=2) if a.shape[2] == 1 else a
    return torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1)


def _from_base64(text: bytes) -> bytes | None:
    try:
        return base64.b64decode(b"".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def _header_size(data: bytes, what: str, max_pixels: int | None) -> tuple[int, int] | None:
    """(width, height) from the header PIL recognises in ``data``, before any decoding; None when it
    recognises none (decoding then says what is wrong, naming the image). Over PIL's own limit (twice its
    MAX_IMAGE_PIXELS) PIL refuses even the header: an ImageInputError when a server limit is set."""
    try:
        with Image.open(io.BytesIO(data)) as probe:
            return probe.size
    except Image.DecompressionBombError as exc:
        if max_pixels is not None:
            raise ImageInputError(f"{what}: {exc}") from None
        return None
    except Exception:  # UnidentifiedImageError, and whatever a damaged header raises
        return None


def _check_resized_size(transform: Transform, image: torch.Tensor, what: str, max_pixels: int) -> None:
    """Refuse an image whose resize (before the crop) would be over ``max_pixels``: a very long, thin image
    passes the limit as sent and then grows by its aspect ratio (a 563-byte 500,000 x 1 PNG took a server
    from 1.1 to 3.4 GB at a 32 px model; at 256 px that is ~100 GB)."""
    height, width = image.shape[-2:]
    pixels = resized_pixels(transform, height, width)
    if pixels is not None and pixels > max_pixels:
        raise ImageInputError(
            f"{what}: {width}x{height} pixels; resized for the model that is {pixels:,} pixels, over the "
            f"limit of {max_pixels:,} (an aspect ratio of {max(height, width) / min(height, width):,.0f}:1)"
        )


@torch.no_grad()
def embed_batch(
    net: nn.Module,
    images: torch.Tensor,
    device: torch.device,
    autocast_dtype: torch.dtype | None = None,
    normalize: Callable[[torch.Tensor], torch.Tensor] = normalize_images,
) -> torch.Tensor:
    """uint8 (B, 3, H, W) batch -> float32 (B, D) L2-normalised embeddings (the model's head normalises).

    ``normalize`` is the backbone's own (``PreprocessConfig.normalizer()``; ImageNet statistics by default).
    The caller puts ``net`` in eval mode; this is the one place test-time inputs are normalised."""
    with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = net(normalize(images.to(device, non_blocking=True)))
    return out.float()


def embed_images(
    net: nn.Module,
    images: Iterable[Any] | Sequence[Any],
    transform: Transform,
    device: torch.device,
    batch_size: int = 64,
    normalize: Callable[[torch.Tensor], torch.Tensor] = normalize_images,
    names: Sequence[str] | None = None,
    max_pixels: int | None = None,
) -> np.ndarray:
    """Embed encoded images or uint8 arrays of any size: each goes through ``transform`` (the test resize +
    centre crop), then batches through :func:`embed_batch`. Returns float32 (N, D). An image that cannot
    be read, or one over ``max_pixels``, is named in the error by ``names`` (file names, say), else by its
    position; no images at all is an ImageInputError too."""
    was_training = net.training
    net.eval()
    rows: list[np.ndarray] = []
    batch: list[torch.Tensor] = []
    try:
        for i, image in enumerate(images):
            what = names[i] if names is not None else f"image {i}"
            tensor = image_tensor(image, what, max_pixels)
            if max_pixels is not None:
                _check_resized_size(transform, tensor, what, max_pixels)
            batch.append(transform(tensor))
            if len(batch) == batch_size:
                rows.append(embed_batch(net, torch.stack(batch), device, None, normalize).cpu().numpy())
                batch = []
        if batch:
            rows.append(embed_batch(net, torch.stack(batch), device, None, normalize).cpu().numpy())
    finally:
        net.train(was_training)
    if not rows:
        raise ImageInputError("no images to embed")
    return np.concatenate(rows).astype(np.float32, copy=False)
