"""The embedded image-text task: scenes drawn with Pillow, with captions and question/answer pairs.

No downloads: every image is generated from a seed, so `example(split, seed, index)` is deterministic
across runs and machines (Python's `random.Random` seeded with a string). The answer is correct by
construction: the scene is sampled first, then drawn, then described.

Question kinds (`KINDS`):

    colour    1-3 different shapes, each its own colour   "what colour is the square?"  -> "red"
    count     1-4 copies of one shape (colours vary)      "how many circles?"           -> "3"
    position  one shape near the left/right/top/bottom    "where is the triangle?"      -> "left"
    digit     one digit in one of FONTS, at varied size   "what digit is shown?"        -> "7"

Images have independent widths and heights in [MIN_SIDE, MAX_SIDE] (aspect ratios up to 2.5:1), a light
random background, and shapes sized relative to the image. Digits use Pillow's built-in fonts only
(the FreeType default font at several sizes, a stroked "bold" variant, a sheared "italic" variant and the
bitmap default font upscaled, "pixel"), so the task does not depend on the fonts of a machine.

Splits: "train" and "heldout" draw from disjoint seed streams (`example("heldout", ...)` never shares an
RNG stream with "train"), so held-out accuracy measures generalisation to unseen scenes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

COLOURS = {
    "red": (220, 40, 40),
    "green": (30, 160, 60),
    "blue": (40, 80, 225),
    "yellow": (235, 195, 20),
    "purple": (140, 50, 180),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("left", "right", "top", "bottom")
FONTS = ("regular", "bold", "italic", "pixel")
KINDS = ("colour", "count", "position", "digit")
SPLITS = ("train", "heldout")
MIN_SIDE, MAX_SIDE = 128, 320  # shapes span several 14-px patches (docs/vision.md "Image sizes")
MAX_COUNT = 4


@dataclass(frozen=True)
class Example:
    """One image with its caption and one question about it (answer correct by construction)."""

    image: Image.Image
    caption: str
    question: str
    answer: str
    kind: str


@dataclass(frozen=True)
class Item:
    """A shape in a scene: kind, colour name, centre (cx, cy) and size (side / diameter) in pixels."""

    shape: str
    colour: str
    cx: float
    cy: float
    size: float


def _background(rng: random.Random) -> tuple[int, int, int]:
    return tuple(rng.randint(225, 255) for _ in range(3))


def _canvas(rng: random.Random) -> Image.Image:
    w, h = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
    return Image.new("RGB", (w, h), _background(rng))


def draw_item(draw: ImageDraw.ImageDraw, item: Item) -> None:
    r, fill = item.size / 2, COLOURS[item.colour]
    box = (item.cx - r, item.cy - r, item.cx + r, item.cy + r)
    if item.shape == "circle":
        draw.ellipse(box, fill=fill)
    elif item.shape == "square":
        draw.rectangle(box, fill=fill)
    elif item.shape == "triangle":
        draw.polygon(
            [(item.cx, item.cy - r), (item.cx - r, item.cy + r), (item.cx + r, item.cy + r)], fill=fill
        )
    else:
        raise ValueError(f"shape must be one of {SHAPES}, got {item.shape!r}")


def _place(
    rng: random.Random, w: int, h: int, n: int, lo: float, hi: float
) -> list[tuple[float, float, float]]:
    """n non-overlapping (cx, cy, size) boxes inside w x h; shrinks the sizes until they fit."""
    m = min(w, h)
    for _ in range(20):
        out: list[tuple[float, float, float]] = []
        for _ in range(400):
            s = max(12.0, rng.uniform(lo, hi) * m)
            cx, cy = rng.uniform(s / 2 + 2, w - s / 2 - 2), rng.uniform(s / 2 + 2, h - s / 2 - 2)
            if all(abs(cx - x) > (s + t) / 2 + 3 or abs(cy - y) > (s + t) / 2 + 3 for x, y, t in out):
                out.append((cx, cy, s))
                if len(out) == n:
                    return out
        lo, hi = lo * 0.85, hi * 0.85
    raise RuntimeError(f"could not place {n} shapes in {w}x{h}")  # unreachable for n <= MAX_COUNT


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _plural(shape: str, n: int) -> str:
    return shape if n == 1 else shape + "s"


def _colour_scene(rng: random.Random, max_shapes: int = 3) -> Example:
    img = _canvas(rng)
    n = rng.randint(1, max_shapes)
    shapes, colours = rng.sample(SHAPES, n), rng.sample(sorted(COLOURS), n)
    boxes = _place(rng, img.width, img.height, n, 0.25, 0.4)
    items = [Item(s, c, *b) for s, c, b in zip(shapes, colours, boxes, strict=True)]
    draw = ImageDraw.Draw(img)
    for it in items:
        draw_item(draw, it)
    target = rng.choice(items)
    caption = " and ".join(_a(f"{it.colour} {it.shape}") for it in items) + "."
    return Example(img, caption, f"what colour is the {target.shape}?", target.colour, "colour")


def _count_scene(rng: random.Random) -> Example:
    img = _canvas(rng)
    n, shape = rng.randint(1, MAX_COUNT), rng.choice(SHAPES)
    boxes = _place(rng, img.width, img.height, n, 0.18, 0.3)
    draw = ImageDraw.Draw(img)
    for b in boxes:
        draw_item(draw, Item(shape, rng.choice(sorted(COLOURS)), *b))
    caption = f"{n} {_plural(shape, n)}."
    return Example(img, caption, f"how many {shape}s?", str(n), "count")


def _position_scene(rng: random.Random) -> Example:
    img = _canvas(rng)
    w, h = img.size
    where, shape, colour = rng.choice(POSITIONS), rng.choice(SHAPES), rng.choice(sorted(COLOURS))
    s = max(12.0, rng.uniform(0.2, 0.32) * min(w, h))
    margin = s / 2 + 2
    edge = {  # centre ranges: near one edge, and within the middle third of the other axis
        "left": ((margin, w * 0.25), (h / 3, 2 * h / 3)),
        "right": ((w * 0.75, w - margin), (h / 3, 2 * h / 3)),
        "top": ((w / 3, 2 * w / 3), (margin, h * 0.25)),
        "bottom": ((w / 3, 2 * w / 3), (h * 0.75, h - margin)),
    }[where]
    (x0, x1), (y0, y1) = edge
    cx, cy = rng.uniform(x0, max(x0, x1)), rng.uniform(y0, max(y0, y1))
    draw_item(ImageDraw.Draw(img), Item(shape, colour, cx, cy, s))
    prep = "on" if where in ("left", "right") else "at"
    caption = f"{_a(colour + ' ' + shape)} {prep} the {where}."
    return Example(img, caption, f"where is the {shape}?", where, "position")


def render_digit(digit: str, font: str, height: int, colour: tuple[int, int, int]) -> Image.Image:
    """RGBA image of one digit about `height` px tall in one of FONTS (transparent background)."""
    if font == "pixel":
        small = ImageFont.load_default_imagefont()
        l, t, r, b = small.getbbox(digit)
        tile = Image.new("L", (r - l + 2, b - t + 2), 0)
        ImageDraw.Draw(tile).text((1 - l, 1 - t), digit, font=small, fill=255)
        scale = max(1, round(height / tile.height))
        mask = tile.resize((tile.width * scale, tile.height * scale), Image.Resampling.NEAREST)
    else:
        f = ImageFont.load_default(size=height)
        stroke = max(1, height // 24) if font == "bold" else 0
        l, t, r, b = f.getbbox(digit, stroke_width=stroke)
        pad = 2 + height // 4 if font == "italic" else 2
        mask = Image.new("L", (r - l + 2 * pad, b - t + 4), 0)
        ImageDraw.Draw(mask).text(
            (pad - l, 2 - t), digit, font=f, fill=255, stroke_width=stroke, stroke_fill=255
        )
        if font == "italic":
            shear = 0.25
            mask = mask.transform(
                mask.size,
                Image.Transform.AFFINE,
                (1, shear, -shear * mask.height / 2, 0, 1, 0),
                Image.Resampling.BILINEAR,
            )
        mask = mask.crop(mask.getbbox())
    out = Image.new("RGBA", mask.size, (*colour, 0))
    out.putalpha(mask)
    return out


def _digit_scene(rng: random.Random) -> Example:
    img = _canvas(rng)
    digit, font, colour = str(rng.randint(0, 9)), rng.choice(FONTS), rng.choice(sorted(COLOURS))
    glyph = render_digit(digit, font, int(rng.uniform(0.45, 0.75) * min(img.size)), COLOURS[colour])
    if glyph.width > img.width - 4 or glyph.height > img.height - 4:
        k = min((img.width - 4) / glyph.width, (img.height - 4) / glyph.height)
        glyph = glyph.resize(
            (max(1, int(glyph.width * k)), max(1, int(glyph.height * k))), Image.Resampling.BILINEAR
        )
    x = rng.randint(2, img.width - glyph.width - 2)
    y = rng.randint(2, img.height - glyph.height - 2)
    img.paste(glyph, (x, y), glyph)
    return Example(img, f"the digit {digit} in {colour}.", "what digit is shown?", digit, "digit")


_SCENES = {"colour": _colour_scene, "count": _count_scene, "position": _position_scene, "digit": _digit_scene}


def check_kinds(kinds: tuple[str, ...], max_shapes: int = 3) -> None:
    """ValueError naming the bad value unless kinds is a non-empty subset of KINDS and max_shapes in 1..3."""
    bad = [k for k in kinds if k not in _SCENES]
    if not kinds or bad:
        raise ValueError(f"kinds must be a non-empty subset of {KINDS}, got {kinds!r}")
    if not (isinstance(max_shapes, int) and 1 <= max_shapes <= len(SHAPES)):
        raise ValueError(f"max_shapes must be an integer in 1..{len(SHAPES)}, got {max_shapes!r}")


def example(
    split: str, seed: int, index: int, kinds: tuple[str, ...] = KINDS, max_shapes: int = 3
) -> Example:
    """The index-th example of a split (deterministic in (split, seed, index, kinds, max_shapes)).

    max_shapes caps the shapes of a colour scene (1 makes the answer the image's only colour: the
    check that the image pathway works at all, docs/vision.md); the other kinds ignore it."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    check_kinds(kinds, max_shapes)
    rng = random.Random(f"k3-vision-synthetic|{split}|{seed}|{index}")
    kind = kinds[index % len(kinds)]
    return _colour_scene(rng, max_shapes) if kind == "colour" else _SCENES[kind](rng)


def examples(
    split: str, seed: int, n: int, start: int = 0, kinds: tuple[str, ...] = KINDS, max_shapes: int = 3
) -> list[Example]:
    """Examples start .. start+n-1 of a split; the kinds cycle, so every kind is equally represented."""
    return [example(split, seed, i, kinds, max_shapes) for i in range(start, start + n)]
