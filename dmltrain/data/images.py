"""Check that a source image decodes before it goes into a shard, and optionally shrink it."""

from __future__ import annotations

import io

from PIL import Image

from dmltrain.data.errors import decode_failure
from dmltrain.data.transforms import flatten

_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


class ImageError(ValueError):
    """The file is not a readable image; the message says why."""


def checked_image(data: bytes, resize: int | None = None) -> tuple[bytes, str]:
    """(bytes, extension) for a sample: the original bytes when possible, so conversion is lossless.

    The whole image is decoded once, because a truncated JPEG only fails when its last scan is read; a
    format other than JPEG/PNG/WebP, or `resize` (shorter side in pixels), re-encodes the image as `flatten`
    gives it (upright, alpha on white, 8 bits): PNG, or JPEG for a JPEG source.
    """
    if not data:
        raise ImageError("empty file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            fmt = image.format
            image.load()
            if resize is None and fmt in _EXT:
                return data, _EXT[fmt]
            return _reencode(image, fmt, resize)
    except ImageError:
        raise
    except Exception as exc:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        raise ImageError(decode_failure(exc)) from exc


def _reencode(image: Image.Image, fmt: str | None, resize: int | None) -> tuple[bytes, str]:
    image = flatten(image, keep_grey=True)  # what training would decode: upright, alpha on white, 8 bits
    if resize is not None:
        w, h = image.size
        scale = resize / min(w, h)
        if scale < 1:
            image = image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC)
    out = io.BytesIO()
    if fmt == "JPEG":
        image.convert("RGB").save(out, format="JPEG", quality=95)
        return out.getvalue(), "jpg"
    image.save(out, format="PNG")
    return out.getvalue(), "png"
