"""The hand-written tar reader (dmltrain.data.shards.iter_tar / read_shard) on real-world tars: webdataset's
ShardWriter, GNU tar in each of its formats, Python's tarfile (GNU long names, pax paths and sizes, global
headers), non-file members, and every way a shard can be cut or damaged, which must fail naming the shard
and the member instead of yielding fewer samples."""

from __future__ import annotations

import functools
import gzip
import http.server
import io
import json
import re
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from dmltrain.data import EvalLoader, TrainLoader, prepare
from dmltrain.data.errors import SampleError
from dmltrain.data.metadata import load_dataset_info
from dmltrain.data.shards import ShardEntry, ShardError, iter_tar, read_shard, write_shard

LONG_DIR = "a-directory-name-long-enough.v2/" * 4  # 128 characters, with dots: only the last part splits
SAMPLE_FILES = {
    "s0.jpg": b"\xff\xd8 image zero",
    "s0.cls": b"3",
    "s0.category": b"1",
    "s1.png": b"\x89PNG image one",
    "s1.cls": b"4",
    f"{LONG_DIR}s2-with-a-long-key-{'x' * 80}.jpg": b"image two",  # 231 characters
    f"{LONG_DIR}s2-with-a-long-key-{'x' * 80}.cls": b"5",
    "ütf8-ключ.webp": b"image three",
    "ütf8-ключ.cls": b"6",
}


def write_files(root: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)


def tar_archive(members: list[tarfile.TarInfo | tuple[str, bytes]], fmt: int, **kw) -> bytes:
    """An archive written by Python's tarfile (regular files given as (name, data))."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, **kw) as archive:
        for m in members:
            if isinstance(m, tarfile.TarInfo):
                archive.addfile(m)
            else:
                info = tarfile.TarInfo(m[0])
                info.size = len(m[1])
                archive.addfile(info, io.BytesIO(m[1]))
    return out.getvalue()


def special(name: str, kind: bytes, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def members_of(data: bytes, url: str = "test.tar") -> list[tuple[str, bytes]]:
    return list(iter_tar(io.BytesIO(data), url))


def regular_members(data: bytes) -> list[tuple[str, bytes]]:
    """What Python's tarfile (the reference) finds in the archive."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        return [(m.name, archive.extractfile(m).read()) for m in archive if m.isreg()]


def header_offsets(data: bytes) -> dict[str, int]:
    """Offset of each member's own ustar header (after any pax or long-name header of its own)."""
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
        return {m.name: m.offset_data - 512 for m in archive}


def patch_header(data: bytes, offset: int, start: int, field: bytes) -> bytes:
    """Overwrite a header field and recompute the header checksum (a valid header with other contents)."""
    block = bytearray(data[offset : offset + 512])
    block[start : start + len(field)] = field
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block)
    return data[:offset] + bytes(block) + data[offset + 512 :]


def check_samples(url: str) -> None:
    samples = list(read_shard(url))
    keys = [s.key.removeprefix("./") for s in samples]
    assert keys == ["s0", "s1", f"{LONG_DIR}s2-with-a-long-key-{'x' * 80}", "ütf8-ключ"]
    assert [(s.cls, s.category) for s in samples] == [(3, 1), (4, -1), (5, -1), (6, -1)]
    assert [s.data for s in samples] == [
        b"\xff\xd8 image zero",
        b"\x89PNG image one",
        b"image two",
        b"image three",
    ]
    assert [s.member for s in samples] == [0, 1, 2, 3]


@pytest.mark.parametrize("fmt", ["gnu", "pax", "ustar", "v7"])
def test_gnu_tar_cli_archives(tmp_path: Path, fmt: str) -> None:
    """GNU tar: ././@LongLink names (gnu), pax path records (pax), name prefixes (ustar), no magic (v7);
    directory members (`tar -C dir .` starts with ./) are skipped."""
    files = dict(SAMPLE_FILES)
    if fmt in ("ustar", "v7"):  # no long names: ustar splits paths at a "/" (prefix <= 155, name <= 100)
        files = {k.replace("x" * 80, "x" * 20): v for k, v in files.items()}
    if fmt == "v7":  # names of at most 99 bytes
        files = {k.replace(LONG_DIR, "dir.v2/"): v for k, v in files.items()}
    write_files(tmp_path / "src", files)
    shard = tmp_path / "shard.tar"
    directories = sorted({"./" + n.rsplit("/", 1)[0] for n in files if "/" in n})
    names = [f"./{n}" for n in sorted(files)]  # a sample's members stay together
    command = ["tar", f"--format={fmt}", "-cf", str(shard), "-C", str(tmp_path / "src"), "--no-recursion"]
    subprocess.run([*command, ".", *directories, *names], check=True)
    data = shard.read_bytes()
    assert members_of(data, str(shard)) == regular_members(data)
    samples = list(read_shard(str(shard)))
    assert len(samples) == 4 and {s.cls for s in samples} == {3, 4, 5, 6}
    by_cls = {s.cls: s for s in samples}
    assert by_cls[3].data == b"\xff\xd8 image zero" and by_cls[3].category == 1
    assert by_cls[5].key.startswith("./") and by_cls[5].key.endswith("x" * 20)


def test_webdataset_shardwriter_shards(tmp_path: Path) -> None:
    """webdataset's ShardWriter (a pax header with the float mtime before every member)."""
    pattern = str(tmp_path / "wds-%04d.tar")
    with wds.ShardWriter(pattern, maxcount=2, verbose=0) as writer:
        for i in range(5):
            writer.write({"__key__": f"k{i}", "jpg": bytes([i]) * (100 + 700 * i), "cls": str(i).encode()})
    urls = sorted(str(p) for p in tmp_path.glob("wds-*.tar"))
    assert len(urls) == 3
    ours = [(s.key, s.data, s.cls) for u in urls for s in read_shard(u)]
    reference = wds.WebDataset(urls, shardshuffle=False, nodesplitter=None, workersplitter=None)
    theirs = [(d["__key__"], d["jpg"], int(d["cls"])) for d in reference]
    assert ours == theirs and len(ours) == 5


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT])
def test_python_tarfile_archives_match_tarfile_reading(tmp_path: Path, fmt: int) -> None:
    rng = np.random.default_rng(fmt)
    members: list[tarfile.TarInfo | tuple[str, bytes]] = [special("./", tarfile.DIRTYPE)]
    for i in range(40):
        length = int(rng.integers(1, 90 if fmt == tarfile.USTAR_FORMAT else 300))
        name = f"d{i}/" + "n" * length + f".{i}"
        members.append((name, rng.bytes(int(rng.integers(0, 2000)))))
        if i % 10 == 0:
            members.append(special(f"d{i}", tarfile.DIRTYPE))
            members.append(special(f"fifo{i}", tarfile.FIFOTYPE))
    data = tar_archive(members, fmt)
    got = members_of(data)
    assert got == regular_members(data) and len(got) == 40
    if fmt != tarfile.USTAR_FORMAT:  # ustar cannot hold the 231-character name (a 103-character last part)
        (tmp_path / "x.tar").write_bytes(tar_archive(list(SAMPLE_FILES.items()), fmt=fmt))
        check_samples(str(tmp_path / "x.tar"))


def test_pax_size_and_global_headers_and_base256_sizes() -> None:
    # A pax size record overrides the ustar size field (how >8 GiB members are stored).
    info = tarfile.TarInfo("big.bin")
    info.size = 1000
    info.pax_headers = {"size": "1000", "comment": "multi\nline value"}
    out = io.BytesIO()
    with tarfile.open(
        fileobj=out, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "global"}
    ) as t:
        t.addfile(info, io.BytesIO(b"z" * 1000))
        small = tarfile.TarInfo("small.cls")
        small.size = 1
        t.addfile(small, io.BytesIO(b"7"))
    data = out.getvalue()
    offset = header_offsets(data)["big.bin"]
    # the ustar size field says 0: only the pax record gives the right size
    patched = patch_header(data, offset, 124, b"00000000000\0")
    assert members_of(patched) == [("big.bin", b"z" * 1000), ("small.cls", b"7")]
    # GNU base-256 size field
    gnu = tar_archive([("member.jpg", b"q" * 777), ("member.cls", b"1")], tarfile.GNU_FORMAT)
    patched = patch_header(gnu, 0, 124, b"\x80" + (777).to_bytes(11, "big"))
    assert members_of(patched) == [("member.jpg", b"q" * 777), ("member.cls", b"1")]


def test_links_are_an_error_not_a_silently_missing_file() -> None:
    for kind, word in ((tarfile.SYMTYPE, "symbolic"), (tarfile.LNKTYPE, "hard")):
        data = tar_archive([("a.cls", b"1"), special("a.jpg", kind, "elsewhere.jpg")], tarfile.PAX_FORMAT)
        with pytest.raises(ShardError, match=rf"test.tar: member 'a.jpg' is a {word} link"):
            members_of(data)


def test_end_of_archive_marker(tmp_path: Path) -> None:
    data = tar_archive([("a.jpg", b"x" * 600), ("a.cls", b"1")], tarfile.USTAR_FORMAT)
    end = header_offsets(data)["a.cls"] + 1024  # header + one data block
    assert members_of(data[: end + 512]) == [("a.jpg", b"x" * 600), ("a.cls", b"1")]  # a lone zero block
    with pytest.raises(ShardError, match=r"ends after member 'a.cls' without the tar end-of-archive marker"):
        members_of(data[:end])  # cut exactly at a member boundary
    with pytest.raises(ShardError, match="data after the tar end-of-archive marker"):
        members_of(data + data)  # `cat a.tar b.tar`: GNU tar would also stop after a.tar


@pytest.mark.parametrize(
    "cut,message",
    [
        (512 + 100, r"truncated: member 'a.jpg' at byte 0 declares 600 bytes, only 100 present"),
        (1024 + 100, r"truncated in the padding of member 'a.jpg'"),
        (1536 + 200, r"truncated inside the header after member 'a.jpg'"),
    ],
)
def test_truncated_shard_names_shard_and_member(tmp_path: Path, cut: int, message: str) -> None:
    data = tar_archive([("a.jpg", b"x" * 600), ("a.cls", b"1")], tarfile.USTAR_FORMAT)
    shard = tmp_path / "cut.tar"
    shard.write_bytes(data[:cut])
    with pytest.raises(ShardError, match=re.escape(f"{shard}: ") + message):
        list(read_shard(str(shard)))


def test_corrupt_headers_fail_with_the_offset() -> None:
    data = tar_archive([("a.jpg", b"x" * 600), ("a.cls", b"1"), ("b.jpg", b"y")], tarfile.USTAR_FORMAT)
    second = header_offsets(data)["a.cls"]
    flipped = bytearray(data)
    flipped[second + 1] ^= 0x20  # one bit in a name: checksum mismatch
    with pytest.raises(ShardError, match=rf"corrupt tar header at byte {second} \(after member 'a.jpg'\)"):
        members_of(bytes(flipped))
    with pytest.raises(ShardError, match="corrupt tar header at byte 0"):
        members_of(b"not a tar file at all".ljust(2048, b"!"))
    with pytest.raises(ShardError, match="test.tar: is gzip-compressed"):
        members_of(gzip.compress(data))
    bad_size = patch_header(data, 0, 124, b"0000000012x\0")
    with pytest.raises(ShardError, match="corrupt tar header at byte 0 \\(size field"):
        members_of(bad_size)


def test_sample_grouping_rules(tmp_path: Path) -> None:
    shard = tmp_path / "g.tar"
    members = [
        ("dir.v1/k1.jpg", b"i1"),
        ("dir.v1/k1.CLS", b"1"),  # extensions are case-insensitive, as in webdataset
        ("README", b"no extension: not part of a sample"),
        ("dir.v1/.hidden", b"no base name"),
        ("k2.jpg", b"i2"),
        ("k2.seg.png", b"mask"),  # the key ends at the first dot of the last path part
        ("k2.cls", b"2"),
        ("k2.json", b'{"path": "x"}'),
    ]
    shard.write_bytes(tar_archive(members, tarfile.PAX_FORMAT))
    samples = list(read_shard(str(shard), with_meta=True))
    assert [(s.key, s.cls, s.category, s.meta) for s in samples] == [
        ("dir.v1/k1", 1, -1, None),
        ("k2", 2, -1, b'{"path": "x"}'),
    ]
    assert [s.key for s in read_shard(str(shard), skip=1)] == ["k2"]
    with pytest.raises(ShardError, match=r"g.tar: holds 2 samples but dataset.json lists 3"):
        list(read_shard(str(shard), expected=3))
    shard.write_bytes(tar_archive([("k.jpg", b"1"), ("k.cls", b"1"), ("k.jpg", b"2")], tarfile.PAX_FORMAT))
    with pytest.raises(ShardError, match="member 'k.jpg' appears twice in sample 'k'"):
        list(read_shard(str(shard)))
    shard.write_bytes(tar_archive([("k.jpg", b"1")], tarfile.PAX_FORMAT))
    with pytest.raises(ShardError, match=r"sample 'k' lacks an image .* or a .cls entry \(has \['jpg'\]\)"):
        list(read_shard(str(shard)))
    shard.write_bytes(tar_archive([("k.jpg", b"1"), ("k.cls", b"one")], tarfile.PAX_FORMAT))
    with pytest.raises(ShardError, match="sample 'k' has a non-integer cls/category"):
        list(read_shard(str(shard)))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tar")
    rng = np.random.default_rng(1)
    for c in range(4):
        for i in range(6):
            path = root / "src" / f"c{c}" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(path)
    prepare("folder", str(root / "src"), root / "out", shard_size=8, progress=False)
    return root / "out"


def test_written_shards_have_no_per_member_pax_headers(prepared: Path) -> None:
    url = load_dataset_info(prepared).shard_urls(prepared, "train")[0]
    with tarfile.open(url) as archive:
        assert all(m.isreg() and not m.pax_headers for m in archive)


def test_loaders_report_a_damaged_shard_by_name(prepared: Path, tmp_path: Path) -> None:
    shutil.copytree(prepared, tmp_path / "out")
    info = load_dataset_info(tmp_path / "out")
    url = info.shard_urls(tmp_path / "out", "train")[0]
    n = info.split("train").shards[0].num_samples
    samples = list(read_shard(url))
    entries = [ShardEntry(s.key, s.data, "png", s.cls, s.category, {}) for s in samples]
    write_shard(url, entries[:-1])  # one sample short and still a valid tar: only dataset.json can tell
    with pytest.raises(
        ShardError, match=re.escape(f"{url}: holds {n - 1} samples but dataset.json lists {n}")
    ):
        list(EvalLoader(tmp_path / "out", "train", 4, rank=0, world_size=1, image_size=8))
    loader = TrainLoader(
        tmp_path / "out", 8, {"name": "pk"}, rank=0, world_size=1, num_workers=0, image_size=8
    )
    with pytest.raises(ShardError, match=f"dataset.json lists {n}"):
        loader.next_batch()
    entries[0].data = b"\x89PNG broken"
    write_shard(url, entries)
    with pytest.raises(
        ValueError, match=re.escape(f"sample {entries[0].key!r} of shard {url}: cannot decode")
    ):
        list(EvalLoader(tmp_path / "out", "train", 4, rank=0, world_size=1, image_size=8))


def test_a_shard_with_more_samples_or_other_labels_than_listed_is_named(
    prepared: Path, tmp_path: Path
) -> None:
    """An evaluation read a listed number of samples and stopped: a shard holding more lost the rest
    silently; a label outside the shard's listed classes became a class of one image, never trained."""
    shutil.copytree(prepared, tmp_path / "out")
    root = tmp_path / "out"
    info = load_dataset_info(root)
    url = info.shard_urls(root, "train")[0]
    n = info.split("train").shards[0].num_samples
    entries = [ShardEntry(s.key, s.data, "png", s.cls, s.category, {}) for s in read_shard(url)]
    write_shard(url, [*entries, ShardEntry("extra", entries[-1].data, "png", entries[-1].cls, 0, {})])
    with pytest.raises(
        ShardError, match=re.escape(f"{url}: holds {n + 1} samples but dataset.json lists {n}")
    ):
        list(EvalLoader(root, "train", 4, rank=0, world_size=1, image_size=8))
    # A capped evaluation reads only its first images, as before.
    assert sum(len(b[3]) for b in EvalLoader(root, "train", 4, image_size=8, max_images=3)) == 3
    listed = dict(info.split("train").shards[0].class_counts)
    own = entries[-1].cls
    other = next(c for c in listed if c != own)
    first = min(own, other)  # the first class whose count differs is named
    held = listed[first] + (1 if first == other else -1)
    for wrong, message in (
        (
            99_999,
            f"sample {entries[-1].key!r} has class 99999, which dataset.json does not list for this shard",
        ),
        (other, f"holds {held} images of class {first} but dataset.json lists {listed[first]}"),
    ):
        write_shard(url, [*entries[:-1], ShardEntry(entries[-1].key, entries[-1].data, "png", wrong, 0, {})])
        with pytest.raises(ShardError, match=re.escape(f"{url}: {message}")):
            list(EvalLoader(root, "train", 4, rank=0, world_size=1, image_size=8))
        loader = TrainLoader(root, 4, {"name": "pk"}, rank=0, world_size=1, num_workers=0, image_size=8)
        with pytest.raises(ShardError, match=re.escape(f"{url}: {message}")):
            for _ in range(12):  # two passes over the shards
                loader.next_batch()


def test_dataset_json_totals_and_ids_must_agree(prepared: Path, tmp_path: Path) -> None:
    """Totals and ids were trusted: a split's steps per epoch, the batch plan and the category of a
    negative class id were built on numbers no shard held."""
    raw = json.loads((prepared / "dataset.json").read_text())
    shard = raw["splits"]["train"]["shards"][0]
    cases = [
        (
            ("splits", "train", "num_samples"),
            100_000,
            "split 'train': its shards hold 24 samples, num_samples is",
        ),
        (("splits", "train", "num_classes"), 3, "split 'train': its shards list 4 classes, num_classes is 3"),
        (("class_to_category",), [0], "class_to_category has 1 entries for 4 classes"),
    ]
    for path, value, message in cases:
        changed = json.loads(json.dumps(raw))
        target = changed
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        (tmp_path / "dataset.json").write_text(json.dumps(changed))
        with pytest.raises(ValueError, match=re.escape(message)):
            load_dataset_info(tmp_path)
    for counts, message in (
        ([[c, n * 3] for c, n in shard["class_counts"]], "class_counts add up to"),
        ([[-3, 1], *shard["class_counts"][1:]], "class_counts names class -3, outside 0..3"),
    ):
        changed = json.loads(json.dumps(raw))
        changed["splits"]["train"]["shards"][0]["class_counts"] = counts
        (tmp_path / "dataset.json").write_text(json.dumps(changed))
        with pytest.raises(ValueError, match=re.escape(f"shard {shard['name']!r}: {message}")):
            load_dataset_info(tmp_path)


@pytest.mark.parametrize("workers", [0, 1])
def test_an_undecodable_image_ends_a_run_with_one_line_naming_it(
    prepared: Path, tmp_path: Path, workers: int
) -> None:
    """Every attempt would replay the same sample, so the worker loop treats the error as fatal; from a
    loader process it arrives wrapped in the DataLoader's traceback, and the run's one line still names it."""
    from dmltrain.service.errors import FATAL_IN_LOOP, as_fatal

    shutil.copytree(prepared, tmp_path / "out")
    url = load_dataset_info(tmp_path / "out").shard_urls(tmp_path / "out", "train")[0]
    entries = [ShardEntry(s.key, b"\x89PNG broken", "png", s.cls, s.category, {}) for s in read_shard(url)]
    write_shard(url, entries)
    loader = TrainLoader(
        tmp_path / "out", 8, {"name": "pk"}, rank=0, world_size=1, num_workers=workers, image_size=8
    )
    with pytest.raises(SampleError) as caught:
        loader.next_batch()
    assert isinstance(caught.value, FATAL_IN_LOOP)
    line = str(as_fatal(caught.value, 0, "step 1"))
    assert re.fullmatch(
        rf"rank 0 step 1: SampleError: sample '[^']+' of shard {re.escape(url)}: cannot decode/transform "
        r"the image: .+",
        line,
    ), line


def eval_batches(root: str | Path) -> list[tuple[list[str], list[int], bytes]]:
    loader = EvalLoader(root, "train", 5, rank=0, world_size=1, num_workers=0, image_size=8)
    return [(keys, labels.tolist(), images.numpy().tobytes()) for images, labels, _, keys in loader]


@pytest.fixture
def http_root(prepared: Path, tmp_path: Path):
    """A copy of the prepared data set behind a real HTTP server on a free loopback port."""
    served = tmp_path / "served"
    shutil.copytree(prepared, served)
    handler = functools.partial(_QuietHandler, directory=str(served))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{server.server_address[1]}", served
        server.shutdown()
        thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_remote_roots_stream_the_same_batches_as_the_local_directory(prepared: Path, http_root) -> None:
    """`data.root` as a URL: http(s) goes through webdataset's curl, other schemes (s3://, memory://, ...)
    through fsspec. Both must give exactly the local batches, metadata included."""
    import fsspec

    local = eval_batches(prepared)
    assert sum(len(keys) for keys, _, _ in local) == load_dataset_info(prepared).split("train").num_samples

    url, _ = http_root
    assert load_dataset_info(url) == load_dataset_info(prepared)
    assert eval_batches(url) == local

    memory = fsspec.filesystem("memory")
    memory.put(str(prepared), "/dmltrain-test-remote", recursive=True)
    try:
        assert eval_batches("memory://dmltrain-test-remote") == local
    finally:
        memory.rm("/dmltrain-test-remote", recursive=True)


def test_a_missing_shard_is_named_locally_and_remotely(http_root) -> None:
    url, served = http_root
    info = load_dataset_info(url)
    missing = info.split("train").shards[1].name
    (served / missing).unlink()
    for root, shard in ((served, served / missing), (url, f"{url}/{missing}")):
        with pytest.raises(ShardError, match=re.escape(f"{shard}: missing or unreadable shard")):
            eval_batches(root)
        loader = TrainLoader(root, 8, {"name": "pk"}, rank=0, world_size=1, num_workers=0, image_size=8)
        with pytest.raises(ShardError, match=re.escape(f"{shard}: missing or unreadable shard")):
            batches = iter(loader)
            for _ in range(10):  # 24 images, batches of 8: the missing shard is reached within 3
                next(batches)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{url}/nowhere/dataset.json not found")):
        load_dataset_info(f"{url}/nowhere")
