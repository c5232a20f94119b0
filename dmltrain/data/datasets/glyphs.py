"""`glyphs`: the embedded default data set, rendered from the typefaces matplotlib ships (no download).

Class = a character, instance = a typeface that really draws it, category = the base character after
removing accents (so a, á, à, â, ä are five classes of one category). A face counts for a character only
if its Unicode cmap maps the code point to a glyph whose name agrees with it (this rejects the TeX-encoded
Computer Modern fonts and the LastResort placeholder font) and the rendering has ink and differs from the
face's missing-glyph box.
"""

from __future__ import annotations

import io
import unicodedata
from collections import defaultdict
from functools import cache
from itertools import repeat
from pathlib import Path

import matplotlib
from PIL import Image, ImageChops, ImageDraw, ImageFont

from dmltrain.data.datasets.base import SourceDataset, SourceItem, split_classes
from dmltrain.data.metadata import Evaluation
from dmltrain.data.pools import process_pool

DEFAULT_MIN_FACES = 12
DEFAULT_IMAGE_SIZE = 64
DEFAULT_UNICODE_CATEGORIES = "LN"  # letters and digits
_UNMAPPED = 0x10FFFD  # a private-use code point no shipped face maps: renders the missing-glyph box
_CHUNK = 32  # code points a pool task renders (about 0.3 s of work)


def font_dir() -> Path:
    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def font_files() -> list[Path]:
    return sorted(font_dir().glob("*.ttf"))


@cache
def faithful_codepoints(path: Path) -> frozenset[int]:
    """Code points the face maps to a glyph whose name spells that code point (Adobe Glyph List)."""
    from fontTools import agl
    from fontTools.ttLib import TTFont

    with TTFont(str(path), lazy=True) as font:
        cmap = font.getBestCmap() or {}
    # Each name decoded once: LastResort maps all 1,114,112 code points to 371 glyphs (9 of 12 s of a scan).
    spelled = {name: agl.toUnicode(name) for name in set(cmap.values())}
    return frozenset(cp for cp, name in cmap.items() if name != ".notdef" and spelled[name] == chr(cp))


def base_character(char: str) -> str:
    """The category: compatibility-decompose, drop combining marks, keep the first remaining character."""
    stripped = "".join(c for c in unicodedata.normalize("NFKD", char) if not unicodedata.combining(c))
    return stripped[0] if stripped else char


def render_glyph(font: ImageFont.FreeTypeFont, char: str, size: int) -> bytes | None:
    """Dark glyph centred on white, shrunk to fit when large; None when the face draws no ink."""
    em = font.size
    canvas = Image.new("L", (3 * em, 3 * em), 0)
    ImageDraw.Draw(canvas).text((em, em), char, font=font, fill=255)
    box = canvas.getbbox()
    if box is None:
        return None
    ink = canvas.crop(box)
    limit = size - 2 * max(1, size // 16)
    scale = min(1.0, limit / max(ink.size))
    if scale < 1.0:
        ink = ink.resize((max(1, round(ink.width * scale)), max(1, round(ink.height * scale))), Image.LANCZOS)
    out = Image.new("L", (size, size), 0)
    out.paste(ink, ((size - ink.width) // 2, (size - ink.height) // 2))
    out = ImageChops.invert(out)
    buffer = io.BytesIO()
    out.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


@cache
def _font(path: Path, em: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(path), size=em)


@cache
def _missing_box(path: Path, em: int, image_size: int) -> bytes | None:
    return render_glyph(_font(path, em), chr(_UNMAPPED), image_size)


def _render_code_points(faces: list[Path], cps: list[int], image_size: int) -> list[list[tuple[str, bytes]]]:
    """Each code point's renderings by the faces that draw it faithfully (a pool task: 1 to 56 faces each)."""
    em = round(image_size * 0.75)
    rendered = []
    for cp in cps:
        renders = []
        for face in faces:
            if cp in faithful_codepoints(face):
                png = render_glyph(_font(face, em), chr(cp), image_size)
                if png is not None and png != _missing_box(face, em, image_size):
                    renders.append((face.name, png))
        rendered.append(renders)
    return rendered


def scan_glyphs(
    min_faces: int = DEFAULT_MIN_FACES,
    image_size: int = DEFAULT_IMAGE_SIZE,
    test_fraction: float = 0.5,
    seed: int = 0,
    unicode_categories: str = DEFAULT_UNICODE_CATEGORIES,
    max_classes: int | None = None,
    workers: int = 1,
) -> SourceDataset:
    """Render every (character, face) pair; keep characters drawn by at least `min_faces` faces.

    `workers` processes render in parallel; the result is the same for any number.
    """
    if min_faces < 2:
        raise ValueError(f"min_faces must be >= 2 (a class needs a positive pair), got {min_faces}")
    faces = font_files()
    coverage = {f: faithful_codepoints(f) for f in faces}  # before the pool: forked workers inherit it
    counts: dict[int, int] = defaultdict(int)
    for cps in coverage.values():
        for cp in cps:
            counts[cp] += 1
    candidates = sorted(
        cp
        for cp, n in counts.items()
        if n >= min_faces and unicodedata.category(chr(cp))[0] in unicode_categories
    )
    chunks = [candidates[i : i + _CHUNK] for i in range(0, len(candidates), _CHUNK)]
    renders: dict[int, list[tuple[str, bytes]]] = {}
    chars: list[int] = []
    with process_pool(workers) as pool:
        run = map if pool is None else pool.map  # both yield in order; the builtin lazily
        results = run(_render_code_points, repeat(faces), chunks, repeat(image_size))
        for chunk, rendered in zip(chunks, results, strict=True):
            for cp, faces_of_cp in zip(chunk, rendered, strict=True):
                if len(faces_of_cp) >= min_faces and (max_classes is None or len(chars) < max_classes):
                    chars.append(cp)
                    renders[cp] = faces_of_cp
            if max_classes is not None and len(chars) >= max_classes:
                break
    names = {cp: f"U+{cp:04X} {chr(cp)}" for cp in chars}
    held_out = split_classes(list(names.values()), test_fraction, seed)
    items = []
    for cp in chars:
        category = base_character(chr(cp))
        split = "test" if names[cp] in held_out else "train"
        for face_name, png in renders[cp]:
            items.append(
                SourceItem(
                    split,
                    names[cp],
                    f"{face_name}#U+{cp:04X}",
                    data=png,
                    category=f"U+{ord(category):04X} {category}",
                    meta={"char": chr(cp), "codepoint": cp, "face": face_name},
                )
            )
    return SourceDataset(
        name="glyphs",
        items=items,
        evaluations=[Evaluation(name="test", query="test")],
        split_order=["train", "test"] if held_out else ["train"],
        notes=[f"rendered from {len(faces)} matplotlib {matplotlib.__version__} font files"],
        options={
            "min_faces": min_faces,
            "image_size": image_size,
            "test_fraction": test_fraction,
            "seed": seed,
            "unicode_categories": unicode_categories,
            "max_classes": max_classes,
        },
    )


def glyphs_source_desc(**options: object) -> str:
    """What `dataset.json` records as the source, so `ensure_glyphs` can tell a matching build cheaply."""
    described = ",".join(f"{k}={options[k]}" for k in sorted(options))
    return f"glyphs:{described},matplotlib={matplotlib.__version__}"
