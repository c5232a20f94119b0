"""One WebDataset tar shard: write it atomically, read it back sample by sample.

Sample layout: `<key>.<jpg|png|webp>` image bytes, `<key>.cls` class id, `<key>.category` category id
(-1 = unlabelled), `<key>.json` source path, split and original ids.

Writing goes through webdataset's `TarWriter`. Reading uses the small tar parser below, because webdataset's
reader (Python's `tarfile` in stream mode) costs 0.15-0.35 ms per sample here, five to six times this one
and 8-17% of decoding and augmenting a 320 x 256 JPEG, where this one costs 2-3% (bench/data.py).
"""

from __future__ import annotations

import json
import os
import zlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import webdataset as wds

from dmltrain.data.urls import open_url

IMAGE_EXTS = ("jpg", "png", "webp", "jpeg")


class ShardError(ValueError):
    """A shard that cannot be read as written: truncated, corrupt or holding something we cannot serve."""


@dataclass(slots=True)
class Sample:
    """A sample as read from a shard; the image stays encoded until a batch is emitted."""

    key: str
    data: bytes
    cls: int
    category: int
    shard: int = -1  # index of the shard in its split's shard list
    member: int = -1  # position of the sample inside that shard
    meta: bytes | None = None
    url: str = ""  # of the shard, for error messages


@dataclass
class ShardRecord:
    """What was written into one shard (or skipped from it), for dataset.json."""

    name: str
    num_samples: int = 0
    class_counts: Counter[int] = field(default_factory=Counter)
    category_counts: Counter[int] = field(default_factory=Counter)
    skipped: list[dict[str, str]] = field(default_factory=list)
    size_bytes: int | None = None  # of the tar file as written


@dataclass
class ShardEntry:
    """A sample to write: key, encoded image, labels and its json metadata."""

    key: str
    data: bytes
    ext: str
    cls: int
    category: int
    meta: dict[str, Any]


def write_shard(path: str, entries: list[ShardEntry]) -> None:
    """Write `entries` to `path` via a temporary file, so a shard is either complete or absent."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        # An integer mtime: a float one makes tarfile add a 1 KiB pax header to every member.
        with open(tmp, "wb") as stream, wds.TarWriter(stream, encoder=False, mtime=0) as writer:
            for e in entries:
                writer.write(
                    {
                        "__key__": e.key,
                        e.ext: e.data,
                        "cls": str(e.cls).encode(),
                        "category": str(e.category).encode(),
                        "json": json.dumps(e.meta, ensure_ascii=False, sort_keys=True).encode(),
                    }
                )
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_shard(
    url: str,
    shard: int = -1,
    skip: int = 0,
    with_meta: bool = False,
    expected: int | None = None,
    class_counts: Sequence[tuple[int, int]] | None = None,
) -> Iterator[Sample]:
    """Samples of one shard in order; the first `skip` are passed over without being parsed.

    Members are grouped into samples as webdataset does: the key is the name up to the first dot of its
    last path component, the rest (lower-cased) is the field. `expected` (the count dataset.json lists)
    turns a shard that was cut at a member boundary or replaced into an error instead of fewer samples;
    `class_counts` (dataset.json's images per class of the shard) does the same for a sample labelled with
    a class the shard does not list (at once) or per-class counts that differ (once read whole). A shard
    that cannot be opened or read (missing file, HTTP 404, a remote reader's failing exit status) is a
    ShardError naming it too.
    """
    try:
        samples = _read_shard(url, shard, skip, with_meta, expected)
        if class_counts is None:
            yield from samples
        else:
            yield from _listed_classes(samples, url, dict(class_counts), whole=skip == 0)
    except ShardError:
        raise
    except OSError as exc:
        raise ShardError(f"{url}: missing or unreadable shard ({exc})") from exc


def _listed_classes(
    samples: Iterator[Sample], url: str, listed: dict[int, int], whole: bool
) -> Iterator[Sample]:
    """``samples``, checked against the classes dataset.json lists for their shard: a label outside them
    was never trained (its one image formed a class of its own) and went unnoticed in evaluation."""
    seen: Counter[int] = Counter()
    for sample in samples:
        if sample.cls not in listed:
            raise ShardError(
                f"{url}: sample {sample.key!r} has class {sample.cls}, which dataset.json does not list for "
                "this shard (shard replaced or damaged after `dmltrain prepare`?)"
            )
        seen[sample.cls] += 1
        yield sample
    if whole and seen != Counter(listed):
        cls = next(c for c in sorted(listed) if seen[c] != listed[c])
        raise ShardError(
            f"{url}: holds {seen[cls]} images of class {cls} but dataset.json lists {listed[cls]} "
            "(shard replaced or damaged after `dmltrain prepare`?)"
        )


def _read_shard(url: str, shard: int, skip: int, with_meta: bool, expected: int | None) -> Iterator[Sample]:
    stream = open_url(url)
    try:
        parts: dict[str, bytes] = {}
        key: str | None = None
        member = 0
        for name, data in iter_tar(stream, url):
            slash = name.rfind("/")
            dot = name.find(".", slash + 1)
            if dot <= slash + 1:  # no extension or no base name: no sample's part (webdataset skips them too)
                continue
            base, ext = name[:dot], name[dot + 1 :].lower()
            if base != key:
                if key is not None:
                    if member >= skip:
                        yield _to_sample(key, parts, url, shard, member, with_meta)
                    member += 1
                    parts = {}
                key = base
            elif ext in parts:
                raise ShardError(f"{url}: member {name!r} appears twice in sample {key!r}")
            parts[ext] = data
        if key is not None:
            if member >= skip:
                yield _to_sample(key, parts, url, shard, member, with_meta)
            member += 1
        if expected is not None and member != expected:
            raise ShardError(
                f"{url}: holds {member} samples but dataset.json lists {expected} "
                f"(shard replaced or damaged after `dmltrain prepare`?)"
            )
    finally:
        stream.close()


def _to_sample(
    key: str, parts: dict[str, bytes], url: str, shard: int, member: int, with_meta: bool
) -> Sample:
    image = None
    for ext in IMAGE_EXTS:
        image = parts.get(ext)
        if image is not None:
            break
    label = parts.get("cls")
    if image is None or label is None:
        raise ShardError(
            f"{url}: sample {key!r} lacks an image ({'/'.join(IMAGE_EXTS)}) or a .cls entry "
            f"(has {sorted(parts)})"
        )
    try:
        cls, category = int(label), int(parts.get("category", b"-1"))
    except ValueError as exc:
        raise ShardError(f"{url}: sample {key!r} has a non-integer cls/category: {exc}") from exc
    return Sample(key, image, cls, category, shard, member, parts.get("json") if with_meta else None, url)


# --- tar parsing -------------------------------------------------------------------------------------------
# ustar header fields (offset, length): name (0, 100), size (124, 12), chksum (148, 8), typeflag (156, 1),
# magic + version (257, 8), prefix (345, 155). Types: POSIX 1003.1-1988 ustar, pax (1003.1-2001) and GNU.

BLOCK = 512
_ZERO_BLOCK = bytes(BLOCK)
_POSIX_MAGIC = b"ustar\x00"  # POSIX ustar/pax headers have a name prefix; GNU ("ustar ") keeps times there
_REGULAR = frozenset(b"0\x007")  # file, pre-POSIX file, contiguous file
_NO_CONTENT = frozenset(b"3456DV")  # devices, directory, FIFO, GNU dump dir, volume label: nothing to serve
_LINKS = frozenset(b"12")
_GNU_LONG_NAME, _GNU_LONG_LINK, _PAX, _PAX_GLOBAL = b"LKxg"
_COMPRESSED = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"))


def iter_tar(stream: IO[bytes], url: str) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of the regular files of a tar stream, in order; anything unexpected is a ShardError.

    Handles ustar, pax (path and size records) and GNU (././@LongLink names, base-256 sizes) archives as
    written by webdataset/`tarfile` and GNU tar; directories, devices and FIFOs are skipped. Every
    header's checksum is verified, the archive must end with its zero-block marker and nothing but zero
    padding may follow it, so a truncated or damaged shard fails here, naming the member, instead of
    yielding fewer or garbled samples. Links and sparse files fail too: their content is not in the
    member, so skipping them would silently drop part of a sample.
    """
    read = stream.read
    offset = 0  # of the current header
    previous = "(none: first member)"  # last member read, for error messages
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        header = read(BLOCK)
        if len(header) < BLOCK:
            header += _read_rest(read, BLOCK - len(header)) if header else b""
            if not header:
                raise ShardError(
                    f"{url}: ends after member {previous!r} without the tar end-of-archive marker "
                    f"(truncated?)"
                )
            if len(header) < BLOCK:
                _check_compressed(header, url, offset)
                raise ShardError(f"{url}: truncated inside the header after member {previous!r}")
        if header == _ZERO_BLOCK:
            _check_trailer(read, url, offset + BLOCK)
            return
        _check_header(header, url, offset, previous)
        kind = header[156]
        if "path" in pax:
            name = pax["path"]
        elif long_name is not None:
            name = long_name
        else:
            name = header[:100].partition(b"\0")[0].decode("utf-8", "surrogateescape")
            if header[257:263] == _POSIX_MAGIC and header[345] != 0:
                prefix = header[345:500].partition(b"\0")[0].decode("utf-8", "surrogateescape")
                name = f"{prefix}/{name}"
        size = int(pax["size"]) if "size" in pax else _number(header[124:136], url, offset, "size")
        data = read(size) if size else b""
        if len(data) < size:
            data += _read_rest(read, size - len(data))
            if len(data) < size:
                raise ShardError(
                    f"{url}: truncated: member {name!r} at byte {offset} declares {size} bytes, "
                    f"only {len(data)} present"
                )
        padding = -size % BLOCK
        if padding and len(read(padding)) < padding:
            raise ShardError(f"{url}: truncated in the padding of member {name!r} at byte {offset}")
        offset += BLOCK + size + padding
        if kind == _GNU_LONG_NAME:
            long_name = data.partition(b"\0")[0].decode("utf-8", "surrogateescape")
            continue
        if kind == _PAX:
            pax = _pax_records(data, url, offset)
            continue
        if kind in (_GNU_LONG_LINK, _PAX_GLOBAL):  # link targets; archive-wide comments (git archive)
            continue
        previous, long_name, member_pax, pax = name, None, pax, {}
        if kind in _REGULAR:
            if member_pax and any(k.startswith("GNU.sparse.") for k in member_pax):
                raise ShardError(f"{url}: member {name!r} is a GNU sparse file, which shards cannot hold")
            yield name, data
        elif kind in _LINKS:
            raise ShardError(
                f"{url}: member {name!r} is a {'hard' if kind == ord('1') else 'symbolic'} link; a stream "
                f"cannot follow it, so its sample would lose that file. Re-create the shard with the "
                f"files themselves (GNU tar: --dereference --hard-dereference)"
            )
        elif kind not in _NO_CONTENT:
            raise ShardError(f"{url}: member {name!r} has unsupported tar type {chr(kind)!r}")


def _read_rest(read: Any, size: int) -> bytes:
    """Keep reading a stream that returns short reads (pipes, sockets) until `size` bytes or the end."""
    chunks = []
    while size > 0:
        chunk = read(size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _check_header(header: bytes, url: str, offset: int, previous: str) -> None:
    try:
        stored = _number(header[148:156], url, offset, "checksum")
    except ShardError:
        stored = -1
    unsigned = _byte_sum(header) - sum(header[148:156]) + 8 * 32  # the checksum field counts as spaces
    if stored == unsigned:
        return
    signed = unsigned - 256 * sum(1 for b in header[:148] + header[156:] if b > 127)  # some old writers
    if stored == signed:
        return
    _check_compressed(header, url, offset)
    raise ShardError(
        f"{url}: corrupt tar header at byte {offset} (after member {previous!r}): checksum mismatch; "
        f"the shard is damaged"
    )


def _check_compressed(header: bytes, url: str, offset: int) -> None:
    for magic, name in _COMPRESSED:
        if offset == 0 and header.startswith(magic):
            raise ShardError(f"{url}: is {name}-compressed; shards are plain (uncompressed) tar files")


def _byte_sum(block: bytes) -> int:
    """sum(block) for a 512-byte block at C speed (sum() costs ~5 us, per member): the low half of Adler-32
    is 1 + the byte sum mod 65521, which is exact for 256 bytes (at most 256 x 255 = 65280)."""
    return (zlib.adler32(block[:256]) & 0xFFFF) + (zlib.adler32(block[256:]) & 0xFFFF) - 2


def _number(field: bytes, url: str, offset: int, what: str) -> int:
    """A numeric header field: NUL/space-terminated octal, or GNU base-256 (high bit of the first byte)."""
    if field[0] & 0x80:
        if field[0] != 0x80:
            raise ShardError(f"{url}: negative {what} in the tar header at byte {offset}")
        return int.from_bytes(field[1:], "big")
    text = field.partition(b"\0")[0].strip()
    try:
        return int(text, 8) if text else 0
    except ValueError as exc:
        raise ShardError(f"{url}: corrupt tar header at byte {offset} ({what} field {field!r})") from exc


def _pax_records(data: bytes, url: str, offset: int) -> dict[str, str]:
    """`<length> <key>=<value>\\n` records (POSIX 1003.1-2001); values may contain newlines."""
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            length = 0
        record = data[space + 1 : pos + length]
        if space < 0 or length <= 0 or not record.endswith(b"\n") or b"=" not in record:
            raise ShardError(f"{url}: corrupt pax header ending at byte {offset}")
        key, _, value = record[:-1].partition(b"=")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    if "size" in records and not records["size"].isdigit():
        raise ShardError(f"{url}: corrupt pax size {records['size']!r} in the header ending at byte {offset}")
    return records


def _check_trailer(read: Any, url: str, offset: int) -> None:
    """After the first zero block only zero padding may follow: data there is a concatenated archive or
    damage, which a reader that stopped here would silently drop."""
    while True:
        chunk = read(1 << 16)
        if not chunk:
            return
        if chunk.count(0) != len(chunk):
            raise ShardError(
                f"{url}: data after the tar end-of-archive marker at byte {offset} (concatenated tar "
                f"files or damage); write one archive per shard"
            )
        offset += len(chunk)
