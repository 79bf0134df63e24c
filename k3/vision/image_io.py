"""Safe image decoding for untrusted uploads: bytes / data: URLs -> PIL image, with limits; content hashes.

Every failure raises `ImageError` (a ValueError) with a `reason` code, so the server maps it to an HTTP
400 for that request alone:

    too_large       encoded size over `max_bytes`
    too_many_pixels width*height over `max_pixels` (checked from the header, before any pixel is decoded)
    too_wide        a side over `max_side`
    not_an_image    not a decodable image, or a format outside `formats`
    truncated       the file ends before its pixel data does
    bad_url         not a data: URL (remote URLs are refused: the server never fetches), bad base64/MIME

`image_hash(img)` is a SHA-256 over the decoded pixels (mode, size, raw bytes), so re-encoding the same
pixels (PNG <-> lossless WebP, other PNG compression levels, metadata) gives the same key, and one changed
pixel gives another. The prefix cache keys image tokens by it (`docs/vision.md`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image, ImageFile

DEFAULT_FORMATS = ("PNG", "JPEG")
_MIME = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/jpg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
}
_DATA_URL = re.compile(
    r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,"
)


class ImageError(ValueError):
    """A rejected image upload; `reason` is one of the codes in the module doc."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class ImageLimits:
    """Upload limits. Defaults admit a 4K photo and stop decompression bombs."""

    max_bytes: int = 20 * 2**20
    max_pixels: int = 40_000_000
    max_side: int = 16384
    formats: tuple[str, ...] = DEFAULT_FORMATS

    def __post_init__(self) -> None:
        for key in ("max_bytes", "max_pixels", "max_side"):
            v = getattr(self, key)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"ImageLimits.{key} must be a positive int, got {v!r}")


def decode_image(data: bytes, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """Encoded PNG/JPEG bytes -> a fully decoded PIL image (RGB, or RGBA/LA when it has alpha)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ImageError("not_an_image", f"image data must be bytes, got {type(data).__name__}")
    if len(data) > limits.max_bytes:
        raise ImageError("too_large", f"image is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(bytes(data)), formats=list(limits.formats))
            _check_size(img.size, limits)
            if ImageFile.LOAD_TRUNCATED_IMAGES:  # a process-wide switch someone may have flipped
                raise ImageError("truncated", "refusing to decode with ImageFile.LOAD_TRUNCATED_IMAGES set")
            img.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError("too_many_pixels", f"image rejected as a decompression bomb: {e}") from None
    except OSError as e:  # Pillow raises OSError("image file is truncated ...") for a cut file
        reason = "truncated" if "truncat" in str(e).lower() else "not_an_image"
        if isinstance(e, Image.UnidentifiedImageError):
            reason = "not_an_image"
        raise ImageError(reason, f"cannot decode image: {e}") from None
    except (SyntaxError, ValueError, TypeError, IndexError, EOFError) as e:
        raise ImageError("not_an_image", f"cannot decode image: {e}") from None
    return _normalise_mode(img)


def _check_size(size: tuple[int, int], limits: ImageLimits) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise ImageError("not_an_image", f"image has an empty size {w}x{h}")
    if max(w, h) > limits.max_side:
        raise ImageError("too_wide", f"image is {w}x{h}; the limit is {limits.max_side} pixels per side")
    if w * h > limits.max_pixels:
        raise ImageError(
            "too_many_pixels", f"image is {w}x{h} = {w * h} pixels; the limit is {limits.max_pixels}"
        )


def _normalise_mode(img: Image.Image) -> Image.Image:
    """RGB, or RGBA when the image carries transparency (composited later, `k3.vision.preprocess`)."""
    has_alpha = img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info)
    return img.convert("RGBA" if has_alpha else "RGB")


def data_url_bytes(url: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """`data:image/png;base64,...` -> the encoded image bytes; http(s) and other schemes raise
    ImageError('bad_url')."""
    if not isinstance(url, str):
        raise ImageError("bad_url", f"image_url must be a string, got {type(url).__name__}")
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0][:16] if ":" in url else "(none)"
        raise ImageError(
            "bad_url",
            f"only data: URLs are accepted (base64 PNG/JPEG); the server does not fetch {scheme!r} URLs",
        )
    m = _DATA_URL.match(url[:512])
    if m is None or not m["b64"]:
        raise ImageError("bad_url", "data: URL must be of the form data:image/<png|jpeg>;base64,<data>")
    mime = (m["mime"] or "").lower()
    if mime not in _MIME or _MIME[mime] not in limits.formats:
        allowed = sorted(k for k, v in _MIME.items() if v in limits.formats)
        raise ImageError("bad_url", f"data: URL MIME type {mime or '(none)'!r} is not one of {allowed}")
    payload = url[m.end() :]
    if len(payload) > (limits.max_bytes * 4) // 3 + 4:  # reject before decoding the base64
        raise ImageError("too_large", f"data: URL payload exceeds the {limits.max_bytes}-byte image limit")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageError("bad_url", f"data: URL has invalid base64: {e}") from None
    if len(data) > limits.max_bytes:
        raise ImageError("too_large", f"image is {len(data)} bytes; the limit is {limits.max_bytes}")
    return data


def image_size(data: bytes, limits: ImageLimits = ImageLimits()) -> tuple[int, int]:
    """(width, height) of encoded image bytes from the header alone (no pixel is decoded), within
    `limits`: the size `decode_image` will return."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(bytes(data)), formats=list(limits.formats)) as img:
                size = img.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError("too_many_pixels", f"image rejected as a decompression bomb: {e}") from None
    except OSError as e:
        raise ImageError("not_an_image", f"cannot decode image: {e}") from None
    except (SyntaxError, ValueError, TypeError, IndexError, EOFError) as e:
        raise ImageError("not_an_image", f"cannot decode image: {e}") from None
    _check_size(size, limits)
    return size


def decode_data_url(url: str, limits: ImageLimits = ImageLimits()) -> Image.Image:
    """`data:image/png;base64,...` -> PIL image; http(s) and other schemes raise ImageError('bad_url')."""
    return decode_image(data_url_bytes(url, limits), limits)


def encode_data_url(img: Image.Image, fmt: str = "PNG") -> str:
    """PIL image -> `data:image/png;base64,...` (tests, clients, the demo)."""
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    mime = {"PNG": "image/png", "JPEG": "image/jpeg"}[fmt]
    return f"data:{mime};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def image_hash(img: Image.Image) -> str:
    """Hex SHA-256 of the decoded pixels: stable across encodings, sensitive to any pixel change."""
    h = hashlib.sha256()
    h.update(f"k3-image-v1|{img.mode}|{img.width}x{img.height}|".encode())
    h.update(img.tobytes())
    return h.hexdigest()
