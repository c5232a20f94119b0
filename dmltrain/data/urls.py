"""Open shards and metadata from a local directory or any URL that webdataset or fsspec understands."""

from __future__ import annotations

import os
from typing import IO
from urllib.parse import urlparse

# Schemes webdataset opens itself (curl, gsutil, shell pipes); everything else goes through fsspec.
_WDS_SCHEMES = {"pipe", "http", "https", "sftp", "ftps", "scp", "gs", "hf", "ais", "htgs"}


def is_local(url: str) -> bool:
    return urlparse(url).scheme in ("", "file") or (len(url) > 1 and url[1] == ":")


def local_path(url: str) -> str:
    parsed = urlparse(url)
    return parsed.path if parsed.scheme == "file" else url


def join_url(root: str, name: str) -> str:
    """`root/name` for a directory path or a URL (a `pipe:` root is not joinable)."""
    if is_local(root):
        return os.path.join(local_path(root), name)
    base, mark, query = root.partition("?")  # s3://b/p?endpoint_override=...: the path before the query
    return base.rstrip("/") + "/" + name + mark + query


def open_url(url: str) -> IO[bytes]:
    """A readable binary stream: local files directly, s3:// etc. via fsspec, the rest via webdataset."""
    if is_local(url):
        return open(local_path(url), "rb")
    scheme = urlparse(url).scheme
    if scheme not in _WDS_SCHEMES:
        import fsspec

        return fsspec.open(url, "rb").open()
    if scheme == "gs":
        try:
            import fsspec

            return fsspec.open(url, "rb").open()
        except (ImportError, ValueError):
            pass
    import webdataset  # here, not at the top: it imports torch, which reading dataset.json does not need

    return webdataset.gopen(url, "rb")


def read_bytes(url: str) -> bytes:
    """The whole file; any failure (including a remote reader's exit status, reported only on close) is
    a FileNotFoundError naming the URL."""
    try:
        with open_url(url) as stream:
            data = stream.read()
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise FileNotFoundError(f"cannot read {url}: {exc}") from exc
    if not data:
        raise FileNotFoundError(f"{url} is empty or missing")
    return data
