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
from pathlib import Path

import matplotlib
from PIL import Image, ImageDraw, ImageFont

from dmltrain.data.datasets.base import SourceDataset, SourceItem, split_classes
from dmltrain.data.metadata import Evaluation

DEFAULT_MIN_FACES = 12
DEFAULT_IMAGE_SIZE = 64
DEFAULT_UNICODE_CATEGORIES = "LN"  # letters and digits
_UNMAPPED = 0x10FFFD  # a private-use code point no shipped face maps: renders the missing-glyph box
_INVERT = [255 - v for v in range(256)]  # as a table: Image.point calls a function 256 times per image


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
        faithful = (cp for cp, name in cmap.items() if name != ".notdef" and agl.toUnicode(name) == chr(cp))
        return frozenset(faithful)


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
    out = out.point(_INVERT)
    buffer = io.BytesIO()
    out.save(buffer, format="PNG", optimize=False)
    return buffer.getvalue()


def scan_glyphs(
    min_faces: int = DEFAULT_MIN_FACES,
    image_size: int = DEFAULT_IMAGE_SIZE,
    test_fraction: float = 0.5,
    seed: int = 0,
    unicode_categories: str = DEFAULT_UNICODE_CATEGORIES,
    max_classes: int | None = None,
) -> SourceDataset:
    """Render every (character, face) pair; keep characters drawn by at least `min_faces` faces."""
    if min_faces < 2:
        raise ValueError(f"min_faces must be >= 2 (a class needs a positive pair), got {min_faces}")
    faces = font_files()
    coverage = {f: faithful_codepoints(f) for f in faces}
    counts: dict[int, int] = defaultdict(int)
    for cps in coverage.values():
        for cp in cps:
            counts[cp] += 1
    candidates = sorted(
        cp
        for cp, n in counts.items()
        if n >= min_faces and unicodedata.category(chr(cp))[0] in unicode_categories
    )
    em = round(image_size * 0.75)
    fonts = {face: ImageFont.truetype(str(face), size=em) for face in faces}
    missing_boxes = {face: render_glyph(font, chr(_UNMAPPED), image_size) for face, font in fonts.items()}
    renders: dict[int, list[tuple[str, bytes]]] = defaultdict(list)
    chars = []
    for cp in candidates:
        if max_classes is not None and len(chars) >= max_classes:
            break
        for face, font in fonts.items():
            if cp in coverage[face]:
                png = render_glyph(font, chr(cp), image_size)
                if png is not None and png != missing_boxes[face]:
                    renders[cp].append((face.name, png))
        if len(renders[cp]) >= min_faces:
            chars.append(cp)
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
