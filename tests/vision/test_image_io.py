"""Upload decoding: limits, bad images -> ImageError with a reason, data: URLs, content hashes."""

import base64
import io
import struct
import zlib

import pytest
from PIL import Image

from k3.vision.image_io import (
    ImageError,
    ImageLimits,
    decode_data_url,
    decode_image,
    encode_data_url,
    image_hash,
)


def _png(img: Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", **kw)
    return buf.getvalue()


def _jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _png_header_only(w: int, h: int) -> bytes:
    """A PNG that claims w x h pixels (IHDR) with one tiny IDAT: a decompression-bomb shaped header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )


IMG = Image.new("RGB", (40, 30), (10, 200, 30))


def test_decode_png_and_jpeg():
    assert decode_image(_png(IMG)).size == (40, 30)
    out = decode_image(_jpeg(IMG))
    assert out.mode == "RGB" and out.size == (40, 30)
    rgba = decode_image(_png(Image.new("RGBA", (5, 5), (1, 2, 3, 0))))
    assert rgba.mode == "RGBA"


@pytest.mark.parametrize(
    "data,reason",
    [
        (b"definitely not an image", "not_an_image"),
        (b"", "not_an_image"),
        (b"GIF89a" + b"\0" * 20, "not_an_image"),  # a format outside the allowed list
    ],
)
def test_not_an_image(data, reason):
    with pytest.raises(ImageError) as e:
        decode_image(data)
    assert e.value.reason == reason
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("encode", [_png, _jpeg])
def test_truncated(encode):
    noisy = Image.effect_noise((64, 64), 50).convert("RGB")
    data = encode(noisy)
    with pytest.raises(ImageError) as e:
        decode_image(data[: len(data) // 2])
    assert e.value.reason in ("truncated", "not_an_image")
    with pytest.raises(ImageError) as e:
        decode_image(_png(noisy)[:-30])
    assert e.value.reason == "truncated"


def test_huge_dimensions_rejected_before_decoding():
    with pytest.raises(ImageError) as e:
        decode_image(_png_header_only(30000, 30000))  # Pillow's own bomb check may fire first
    assert e.value.reason in ("too_wide", "too_many_pixels")
    with pytest.raises(ImageError) as e:
        decode_image(_png_header_only(20000, 100))
    assert e.value.reason == "too_wide"
    with pytest.raises(ImageError) as e:
        decode_image(_png_header_only(10000, 9000))
    assert e.value.reason == "too_many_pixels"
    with pytest.raises(ImageError) as e:
        decode_image(_png(IMG), ImageLimits(max_bytes=10))
    assert e.value.reason == "too_large"


def test_data_urls():
    url = encode_data_url(IMG)
    assert url.startswith("data:image/png;base64,")
    assert image_hash(decode_data_url(url)) == image_hash(IMG)
    jpg = "data:image/jpeg;base64," + base64.b64encode(_jpeg(IMG)).decode()
    assert decode_data_url(jpg).size == (40, 30)
    for bad in ["https://example.com/cat.png", "file:///etc/passwd", "data:image/png,rawbytes",
                "data:image/png;base64,@@@", "data:text/plain;base64,aGVsbG8="]:  # fmt: skip
        with pytest.raises(ImageError) as e:
            decode_data_url(bad)
        assert e.value.reason == "bad_url", bad
    big = "data:image/png;base64," + "A" * 100
    with pytest.raises(ImageError) as e:
        decode_data_url(big, ImageLimits(max_bytes=16))
    assert e.value.reason == "too_large"


def test_image_hash_stable_and_content_sensitive():
    h = image_hash(decode_image(_png(IMG)))
    assert h == image_hash(decode_image(_png(IMG, compress_level=1)))  # other encoding, same pixels
    assert len(h) == 64
    other = IMG.copy()
    other.putpixel((3, 3), (10, 200, 31))
    assert image_hash(other) != h
    assert image_hash(IMG.resize((30, 40))) != h
