"""Image geometry: the papers' warp mode (every image to resize x resize first) against the aspect-keeping
default, for training and test, and its pass-through from the loaders on real shards. Decoding: alpha,
16-bit grey and EXIF orientation (`flatten`), the same in `decode` and prepare's re-encode."""

from __future__ import annotations

import csv
import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import v2

from dmltrain.data import EvalLoader, SamplerSpec, TrainAugment, TrainLoader, prepare, train_transform
from dmltrain.data import test_transform as eval_transform
from dmltrain.data.errors import SampleError
from dmltrain.data.images import checked_image
from dmltrain.data.loader import DECODE_BLOCK, collate
from dmltrain.data.shards import Sample
from dmltrain.data.transforms import decode, treats_channels_alike


def banded(height: int = 40, width: int = 80) -> torch.Tensor:
    """Three vertical bands (50 | 150 | 250) over the width: 1/4, 1/2, 1/4 of it."""
    image = torch.full((3, height, width), 150, dtype=torch.uint8)
    image[:, :, : width // 4] = 50
    image[:, :, 3 * width // 4 :] = 250
    return image


def test_warp_test_transform_sees_the_whole_width_the_default_crops_it_away() -> None:
    image = banded()
    kept = eval_transform(24, resize=32)(image)  # shorter side 40 -> 32 (64 wide), centre 24 columns
    warped = eval_transform(24, resize=32, resize_mode="warp")(image)  # 32 x 32, centre 24 columns
    assert kept.shape == warped.shape == (3, 24, 24) and warped.dtype == torch.uint8
    assert set(kept.unique().tolist()) == {150}
    assert warped.min() <= 60 and warped.max() >= 240  # both outer bands survive the warp
    expected = v2.CenterCrop(24)(v2.Resize((32, 32), antialias=True)(image))
    assert torch.equal(warped, expected)
    assert torch.equal(eval_transform(24, resize=32, resize_mode="warp")(image), warped)  # deterministic


def test_warp_train_transform_crops_the_warped_square() -> None:
    image = banded()
    # scale and ratio 1: the crop is the whole warped square, so the result is fully determined
    whole = train_transform(24, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False, resize_mode="warp", resize=32)
    expected = v2.Resize((24, 24), antialias=True)(v2.Resize((32, 32), antialias=True)(image))
    assert torch.equal(whole(image), expected)
    assert whole(image).min() <= 60 and whole(image).max() >= 240

    augment = train_transform(24, scale=(0.5, 1.0), resize_mode="warp")  # resize defaults to 24 x 256/224
    outs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        outs.append(augment(image))
    assert all(o.shape == (3, 24, 24) and o.dtype == torch.uint8 for o in outs)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])


def test_unknown_resize_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="resize_mode must be one of"):
        train_transform(24, resize_mode="stretch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="resize_mode must be one of"):
        eval_transform(24, resize_mode="pad")  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def wide_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real shards of wide (16 x 40) PNGs: 4 classes x 4 images for train and test."""
    root = tmp_path_factory.mktemp("wide")
    rng = np.random.default_rng(0)
    rows = []
    (root / "img").mkdir()
    for split in ("train", "test"):
        for c in range(4):
            for i in range(4):
                rel = f"img/{split}{c}_{i}.png"
                Image.fromarray(rng.integers(0, 256, (16, 40, 3), dtype=np.uint8)).save(root / rel)
                rows.append([rel, f"{split}{c}", split])
    with (root / "list.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "class", "split"])
        writer.writerows(rows)
    prepare("csv", str(root / "list.csv"), root / "out", shard_size=8, progress=False)
    return root / "out"


def test_loaders_pass_the_resize_mode_through(wide_shards: Path) -> None:
    evaluated = EvalLoader(wide_shards, "test", 16, image_size=8, resize=12, resize_mode="warp")
    images, _labels, _categories, keys = next(iter(evaluated))
    raw = {}
    for batch in EvalLoader(wide_shards, "test", 16, transform=lambda x: x):
        raw.update(dict(zip(batch[3], batch[0], strict=True)))
    expected = eval_transform(8, 12, "warp")
    for image, key in zip(images, keys, strict=True):
        assert torch.equal(image, expected(raw[key]))
    assert not torch.equal(images[0], eval_transform(8, 12)(raw[keys[0]]))

    spec = SamplerSpec(name="pk", samples_per_class=2, seed=1)
    train = TrainLoader(
        wide_shards, 8, spec, rank=0, world_size=1, num_workers=0, image_size=8, resize_mode="warp", resize=12
    )
    assert isinstance(train.transform, TrainAugment) and train.transform.warp == 12
    batch, _, _ = train.next_batch()
    assert batch.shape == (8, 3, 8, 8)


def test_data_flip_false_never_mirrors_a_training_image(tmp_path: Path) -> None:
    """data.flip: false (glyphs: a mirrored b is a d) reaches the service's training transform."""
    from dmltrain.service.builders import build_train_transform
    from dmltrain.service.config import load_config

    repo = Path(__file__).parents[1]
    image = torch.zeros((3, 32, 32), dtype=torch.uint8)
    image[:, :, :8] = 255  # bright left edge: a mirror puts it on the right
    full_crop = ["data.crop_scale=[1.0, 1.0]", "data.image_size=32"]
    for flip, expect_mirrors in ((False, False), (True, True)):
        config = load_config(repo / "configs" / "quickstart.yaml", [*full_crop, f"data.flip={flip}"])
        transform = build_train_transform(config)
        torch.manual_seed(0)
        mirrored = [bool(transform(image)[:, :, -1].float().mean() > 128) for _ in range(40)]
        assert any(mirrored) is expect_mirrors, (flip, mirrored)


def _png(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array).save(out, format="PNG")
    return out.getvalue()


def test_grey_sources_go_through_one_channel_and_come_out_as_their_rgb_conversion() -> None:
    """The loaders decode a greyscale PNG to one channel for this module's (geometric) transforms and repeat
    it afterwards: pixel for pixel what decoding to RGB first gives, at a third of the pixel work. A user's
    transform, which may treat channels differently, still gets RGB."""
    rng = np.random.default_rng(0)
    grey = [rng.integers(0, 256, (h, w), dtype=np.uint8) for h, w in [(40, 30), (64, 64), (24, 24), (17, 90)]]
    colour = rng.integers(0, 256, (20, 28, 3), dtype=np.uint8)
    samples = [Sample(f"s{i}", _png(a), cls=i, category=0) for i, a in enumerate([*grey, colour])]
    assert decode(samples[0].data, keep_grey=True).shape == (1, 40, 30)
    assert decode(samples[-1].data, keep_grey=True).shape == (3, 20, 28)  # colour sources stay RGB
    transforms = [
        train_transform(24, scale=(0.16, 1.0)),
        train_transform(24, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False),  # 24 x 24: the crop is the image
        train_transform(24, resize_mode="warp", resize=32),
        eval_transform(24, resize=32),
    ]
    for transform in transforms:
        assert treats_channels_alike(transform)
        for seed in range(5):
            torch.manual_seed(seed)
            images, labels, _ = collate(samples, transform)
            torch.manual_seed(seed)
            expected = torch.stack([transform(decode(s.data)) for s in samples])
            assert images.shape == (len(samples), 3, 24, 24) and torch.equal(images, expected)
            assert labels.tolist() == list(range(len(samples)))
    seen: list[tuple[int, ...]] = []

    def user_transform(image: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(image.shape))
        return v2.functional.center_crop(image, [16, 16])

    assert not treats_channels_alike(user_transform)
    assert collate(samples[:1], user_transform)[0].shape == (1, 3, 16, 16) and seen == [(3, 40, 30)]


def test_collate_decodes_in_blocks_and_gives_the_image_by_image_batch() -> None:
    """collate decodes DECODE_BLOCK images, then transforms them (cheaper than alternating): the crops still
    draw the same random numbers in the same order, and a bad image is still named."""
    rng = np.random.default_rng(1)
    count = 2 * DECODE_BLOCK + 5  # three blocks, the last one short
    arrays = [rng.integers(0, 256, (int(rng.integers(20, 50)), 33), dtype=np.uint8) for _ in range(count)]
    samples = [Sample(f"s{i}", _png(a), cls=i, category=0) for i, a in enumerate(arrays)]
    transform = train_transform(16, scale=(0.2, 1.0))
    torch.manual_seed(3)
    images, labels, _ = collate(samples, transform)
    torch.manual_seed(3)
    expected = torch.stack([transform(decode(s.data)) for s in samples])
    assert torch.equal(images, expected) and labels.tolist() == list(range(count))
    broken = [*samples[: DECODE_BLOCK + 2], Sample("bad", b"not an image", cls=0, category=0)]
    with pytest.raises(SampleError, match=r"sample 'bad' .*cannot decode/transform the image"):
        collate(broken, transform)


def _encoded(image: Image.Image, fmt: str = "PNG", **params: object) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **params)
    return out.getvalue()


def _chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).permute(2, 0, 1)


def _convert_rgb(data: bytes) -> torch.Tensor:
    """What decode did before it handled alpha, 16 bits and EXIF: PIL's convert("RGB")."""
    with Image.open(io.BytesIO(data)) as image:
        return _chw(np.array(image.convert("RGB")))


def _png16(array: np.ndarray) -> bytes:
    """A 16-bit PNG (grey (H, W) or RGB (H, W, 3) uint16) written by hand: PIL writes no 16-bit RGB."""
    height, width = array.shape[:2]
    colour_type = 2 if array.ndim == 3 else 0
    rows = array.astype(">u2").reshape(height, -1).view(np.uint8)
    raw = b"".join(b"\0" + row.tobytes() for row in rows)  # filter type 0 on every row

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )


def _square(height: int = 20, width: int = 30) -> np.ndarray:
    """True on the square rows 5-14, columns 10-19."""
    inside = np.zeros((height, width), bool)
    inside[5:15, 10:20] = True
    return inside


def test_transparent_images_are_composited_onto_white() -> None:
    """A black square on a transparent background whose hidden colour is black (as most cut-outs store it):
    convert("RGB") dropped alpha and gave an all-black image; now the background is white, whatever the
    kind of transparency. Partial alpha blends; grey with alpha keeps one channel under keep_grey."""
    inside = _square()
    black_on_white = _chw(np.where(inside[..., None], 0, 255).astype(np.uint8).repeat(3, axis=2))
    alpha = np.where(inside, 255, 0).astype(np.uint8)
    rgba = np.dstack([np.zeros((20, 30, 3), np.uint8), alpha])
    palette = Image.fromarray(inside.astype(np.uint8), "L").convert("P")  # index 1: square, 0: background
    palette.putpalette([0, 0, 0] * 2)  # both black
    sources = {
        "RGBA": _encoded(Image.fromarray(rgba, "RGBA")),
        "LA": _encoded(Image.fromarray(rgba[..., 2:], "LA")),
        "P + tRNS index": _encoded(palette, transparency=0),
        "P + tRNS alphas": _encoded(palette, transparency=b"\x00\xff"),
        "WebP RGBA": _encoded(Image.fromarray(rgba, "RGBA"), "WEBP", lossless=True),
    }
    for kind, data in sources.items():
        assert int(_convert_rgb(data).max()) == 0, kind  # the bug: all black
        assert torch.equal(decode(data), black_on_white), kind
    # a transparent colour (tRNS) in an L or RGB PNG: value 0 is transparent, the square is grey 50
    grey = np.where(inside, 50, 0).astype(np.uint8)
    grey_on_white = np.where(inside, 50, 255).astype(np.uint8)
    for image in (Image.fromarray(grey, "L"), Image.fromarray(grey, "L").convert("RGB")):
        data = _encoded(image, transparency=0 if image.mode == "L" else (0, 0, 0))
        assert torch.equal(decode(data), _chw(grey_on_white[..., None].repeat(3, axis=2))), image.mode
    # half transparent black: half way to white; grey sources stay one channel and repeat to the same RGB
    half = _encoded(Image.fromarray(np.dstack([grey * 0, np.full_like(grey, 128)]), "LA"))
    assert torch.equal(decode(half), torch.full((3, 20, 30), 127, dtype=torch.uint8))
    assert decode(sources["LA"], keep_grey=True).shape == (1, 20, 30)
    assert torch.equal(decode(sources["LA"], keep_grey=True).expand(3, -1, -1), black_on_white)


def test_16_bit_grey_is_scaled_to_8_bits_and_16_bit_rgb_still_decodes() -> None:
    """convert("RGB") clipped 16-bit grey (PIL mode I;16) to 255: every such image came out white."""
    values = np.array([[0, 257, 32896, 65535], [128, 32767, 65407, 65535]], dtype=np.uint16)
    data = _png16(values)
    with Image.open(io.BytesIO(data)) as image:
        assert image.mode == "I;16"
    assert torch.equal(_convert_rgb(data)[:, 0, 1:], torch.full((3, 3), 255, dtype=torch.uint8))
    expected = torch.tensor([[0, 1, 128, 255], [0, 127, 255, 255]], dtype=torch.uint8)  # value / 257, rounded
    assert torch.equal(decode(data), expected.expand(3, -1, -1))
    assert torch.equal(decode(data, keep_grey=True), expected.unsqueeze(0))
    assert torch.equal(
        decode(_png16(np.full((3, 5), 32896, np.uint16))), torch.full((3, 3, 5), 128, dtype=torch.uint8)
    )
    # 16-bit RGB: PIL reduces it to 8 bits itself (mode RGB); unchanged
    rgb = np.random.default_rng(0).integers(0, 65536, (6, 7, 3)).astype(np.uint16)
    rgb16 = _png16(rgb)
    assert torch.equal(decode(rgb16), _convert_rgb(rgb16))
    assert (decode(rgb16).int() - _chw(rgb // 257).int()).abs().max() <= 1


@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied(orientation: int) -> None:
    """A camera stores the pixels as the sensor read them plus an EXIF orientation; convert("RGB") ignored
    the tag. The same JPEG pixels with and without the tag decode to the upright image of each other."""
    rng = np.random.default_rng(orientation)
    pixels = rng.integers(0, 256, (24, 40, 3), dtype=np.uint8)  # not square: 90-degree turns swap the sides
    plain = _chw(np.array(Image.open(io.BytesIO(_encoded(Image.fromarray(pixels), "JPEG", quality=95)))))
    exif = Image.Exif()
    exif[0x0112] = orientation
    tagged = _encoded(Image.fromarray(pixels), "JPEG", quality=95, exif=exif)
    upright = {  # the stored image (C, H, W) turned upright, per EXIF 2.3's definition of the tag
        1: lambda t: t,
        2: lambda t: t.flip(-1),  # mirrored
        3: lambda t: t.rot90(2, (1, 2)),  # rotated 180
        4: lambda t: t.flip(-2),  # mirrored upside down
        5: lambda t: t.transpose(1, 2),  # mirrored and turned: the transpose
        6: lambda t: t.rot90(-1, (1, 2)),  # stored turned left: turn right
        7: lambda t: t.rot90(2, (1, 2)).transpose(1, 2),  # the anti-diagonal transpose
        8: lambda t: t.rot90(1, (1, 2)),  # stored turned right: turn left
    }[orientation]
    assert torch.equal(decode(tagged), upright(plain))
    grey = Image.fromarray(pixels[..., 0])  # the keep_grey path turns too
    plain_grey = np.array(Image.open(io.BytesIO(_encoded(grey, "JPEG", quality=95))))
    tagged_grey = _encoded(grey, "JPEG", quality=95, exif=exif)
    assert torch.equal(
        decode(tagged_grey, keep_grey=True), upright(torch.from_numpy(plain_grey).unsqueeze(0))
    )


def test_ordinary_images_decode_exactly_as_before() -> None:
    """8-bit RGB, grey (with and without keep_grey), palette and CMYK sources: convert("RGB") to the bit."""
    rng = np.random.default_rng(5)
    rgb = rng.integers(0, 256, (33, 47, 3), dtype=np.uint8)
    image = Image.fromarray(rgb)
    sources = [
        _encoded(image),
        _encoded(image, "JPEG", quality=90),
        _encoded(image, "WEBP", quality=80),
        _encoded(image.convert("L")),
        _encoded(image.convert("L"), "JPEG"),
        _encoded(image.convert("P")),
        _encoded(image.convert("CMYK"), "JPEG"),
        _encoded(image.convert("1")),
    ]
    assert torch.equal(decode(sources[0]), _chw(rgb))
    for data in sources:
        assert torch.equal(decode(data), _convert_rgb(data))
    for data in sources[3:5]:
        with Image.open(io.BytesIO(data)) as grey:
            assert torch.equal(decode(data, keep_grey=True), torch.from_numpy(np.array(grey)).unsqueeze(0))


def test_prepare_re_encodes_what_decode_gives() -> None:
    """`dmltrain prepare --resize` (and formats it re-encodes) stores the flattened image: upright, alpha on
    white, 8 bits, so training decodes what it would have decoded from the original (a re-encoded JPEG
    used to lose its EXIF orientation, a 16-bit PNG to turn white, a palette PNG its transparency)."""
    inside = _square()
    rgba = np.dstack([np.zeros((20, 30, 3), np.uint8), np.where(inside, 255, 0).astype(np.uint8)])
    palette = Image.fromarray(inside.astype(np.uint8), "L").convert("P")
    palette.putpalette([0, 0, 0] * 2)
    exif = Image.Exif()
    exif[0x0112] = 6
    yy, xx = np.mgrid[0:24, 0:40]
    photo = np.dstack([yy * 10, xx * 6, 240 - yy * 5 - xx * 3]).astype(np.uint8)  # smooth: JPEG keeps it
    sources = [
        _encoded(Image.fromarray(rgba, "RGBA")),
        _encoded(palette, transparency=0),
        _encoded(Image.fromarray(rgba, "RGBA"), "TIFF"),
        _png16(np.full((20, 30), 32896, np.uint16)),
        _encoded(Image.fromarray(photo), "JPEG", quality=95, exif=exif),
    ]
    for data in sources:
        stored, ext = checked_image(data, resize=1000)  # re-encoded, not shrunk
        assert ext == ("jpg" if data[:2] == b"\xff\xd8" else "png")
        expected, got = decode(data), decode(stored)
        assert got.shape == expected.shape
        assert (got.int() - expected.int()).abs().float().mean() < (2 if ext == "jpg" else 1e-9)
    assert decode(checked_image(sources[-1], resize=12)[0]).shape == (3, 20, 12)  # upright, shorter side 12
    grey, _ = checked_image(sources[3], resize=10)
    with Image.open(io.BytesIO(grey)) as image:
        assert image.mode == "L" and image.size == (15, 10) and set(np.array(image).ravel()) == {128}


def _tiff(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="TIFF")
    return out.getvalue()


def test_float_grey_is_read_as_0_to_1_or_0_to_255_and_any_other_range_refused() -> None:
    """convert("RGB") clipped 32-bit float TIFFs (PIL mode F) to 0..255: the usual 0..1 floats came out black,
    and `dmltrain prepare` wrote them into shards that way."""
    unit = np.array([[0.0, 0.25, 0.5], [0.75, 1.0, 0.002]], dtype=np.float32)
    data = _tiff(Image.fromarray(unit, "F"))
    with Image.open(io.BytesIO(data)) as image:
        assert image.mode == "F"
    assert int(_convert_rgb(data).max()) <= 1  # what PIL alone gives: black
    expected = torch.tensor([[0, 64, 128], [191, 255, 1]], dtype=torch.uint8)  # 255 x value, rounded
    assert torch.equal(decode(data), expected.expand(3, -1, -1))
    assert torch.equal(decode(data, keep_grey=True), expected.unsqueeze(0))
    eight_bit = _tiff(Image.fromarray(unit * 200 + 3, "F"))  # already 0..255: kept, rounded
    assert torch.equal(decode(eight_bit)[0], torch.tensor([[3, 53, 103], [153, 203, 3]], dtype=torch.uint8))
    # prepare re-encodes a TIFF as PNG from the same 8 bits
    png, ext = checked_image(data)
    assert ext == "png" and torch.equal(decode(png, keep_grey=True), expected.unsqueeze(0))
    for bad, why in (
        (unit - 0.5, r"\[-0.5, 0.5\]"),
        (unit * 1000, r"\[0, 1000\]"),
        (np.where(unit > 0.5, np.nan, unit), "NaN"),
    ):
        with pytest.raises(ValueError, match=why):
            decode(_tiff(Image.fromarray(bad.astype(np.float32), "F")))
        with pytest.raises(ValueError, match=f"ValueError: .*{why}"):
            checked_image(_tiff(Image.fromarray(bad.astype(np.float32), "F")))
