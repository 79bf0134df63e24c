"""Images through the chat API: a real `k3 serve` process on a random-init k3-tiny-vl checkpoint.
data: URLs are accepted, remote URLs and bad images answer 400 without harming the next request, literal
placeholders are refused, and the image hash keys the prefix cache."""

import base64
import io
import json
import os
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zlib

import pytest
from PIL import Image

from k3.chat_format import ChatOptions, render
from k3.tokenizer import K3Tokenizer
from k3.vision.config import IMAGE_PLACEHOLDER
from k3.vision.image_io import encode_data_url
from k3.vision.media import MediaIds, encode_segments_with_images
from k3.vision.preprocess import num_image_tokens

MODEL = "kimi-k3"
SYSTEM = "you answer questions about images. " * 6  # a shared text prefix of several cache units


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory):
    import torch

    from k3.checkpoint.vl import save_vl_checkpoint
    from k3.model.multimodal import K3VLForCausalLM, init_vl_weights
    from k3.tokenizer_train import train_tokenizer
    from k3.vision.config import vl_preset

    torch.manual_seed(0)
    model = K3VLForCausalLM(vl_preset("k3-tiny-vl"))
    init_vl_weights(model, seed=0)
    tok = train_tokenizer([SYSTEM, "what colour is the square? image 112x112 red"] * 20, vocab_size=1024)
    return save_vl_checkpoint(model, tmp_path_factory.mktemp("vl") / "tiny-vl", tok)


@pytest.fixture(scope="module")
def vl_server(vl_checkpoint):
    port = _free_port()
    cmd = [sys.executable, "-m", "k3.serve.cli", str(vl_checkpoint), "--port", str(port),
           "--max-model-len", "512", "--page-size", "16", "--max-num-seqs", "4",
           "--shutdown-after", "240"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("server did not come up in 60 s")
    yield url
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def post(server: str, messages, max_tokens: int = 3) -> tuple[int, dict]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "chat_template_kwargs": {"thinking": False}}  # fmt: skip
    req = urllib.request.Request(server + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def image_message(url: str, question: str = "what colour is the square?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def png_url(colour, size=(112, 112)) -> str:
    return encode_data_url(Image.new("RGB", size, colour))


def _b64(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def _png_header(w: int, h: int) -> bytes:
    """A PNG claiming w x h pixels with one tiny IDAT (decompression-bomb shaped)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0"))
        + chunk(b"IEND", b"")
    )


def _truncated_png() -> bytes:
    buf = io.BytesIO()
    Image.effect_noise((96, 96), 60).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()[: len(buf.getvalue()) // 2]


def test_image_request_answers(vl_server):
    status, body = post(vl_server, image_message(png_url((220, 30, 30))))
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] > num_image_tokens(112, 112, _media())
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def _media():
    from k3.vision.config import vl_preset

    return vl_preset("k3-tiny-vl").media


def test_remote_url_refused(vl_server):
    status, body = post(vl_server, image_message("https://example.com/cat.png"))
    assert status == 400
    assert "data: URLs" in body["error"]["message"] and "'https'" in body["error"]["message"]


@pytest.mark.parametrize(
    "url, reason",
    [
        (_b64(_truncated_png()), "truncated"),
        (_b64(_png_header(17000, 100)), "too_wide"),
        (_b64(_png_header(60000, 60000)), "too_many_pixels"),
        (_b64(b"this is not an image at all"), "not_an_image"),
        ("data:image/png;base64,@@@", "bad_url"),
        ("data:text/plain;base64,aGVsbG8=", "bad_url"),
    ],
    ids=["truncated", "too_wide", "huge", "not_an_image", "bad_base64", "bad_mime"],
)
def test_bad_image_is_400_and_the_next_request_works(vl_server, url, reason):
    status, body = post(vl_server, image_message(url))
    assert status == 400, body
    assert f"({reason})" in body["error"]["message"]
    status, body = post(vl_server, image_message(png_url((30, 30, 220))))
    assert status == 200, body


def test_literal_placeholder_in_text_refused(vl_server):
    msgs = image_message(png_url((0, 200, 0)), f"what is {IMAGE_PLACEHOLDER}?")
    status, body = post(vl_server, msgs)
    assert status == 400 and "placeholder" in body["error"]["message"]
    status, body = post(vl_server, [{"role": "user", "content": f"{IMAGE_PLACEHOLDER} hi"}])
    assert status == 400 and "placeholder" in body["error"]["message"]


def test_image_hash_keys_the_prefix_cache(vl_server, vl_checkpoint):
    """Same text, another image: nothing at or after the image is served from the cache."""
    tok = K3Tokenizer.from_dir(vl_checkpoint)
    n_img = num_image_tokens(112, 112, _media())
    segs = render(image_message(png_url((0, 0, 0)))[:1] + [{"role": "user", "content": IMAGE_PLACEHOLDER
                  + "what colour is the square?"}], options=ChatOptions(thinking=False))  # fmt: skip
    ids = encode_segments_with_images(tok, segs, [((112, 112), n_img)])
    pad_start = ids.index(MediaIds.of(tok).pad)
    a, b = png_url((250, 200, 10)), png_url((10, 200, 250))
    assert post(vl_server, image_message(a))[0] == 200
    status, again = post(vl_server, image_message(a))
    assert status == 200
    assert again["usage"]["prompt_tokens"] == len(ids)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= pad_start + n_img  # image reused
    status, other = post(vl_server, image_message(b))
    assert status == 200
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= pad_start


def test_text_only_server_refuses_images(server):
    body = {"model": MODEL, "max_tokens": 2, "messages": image_message(png_url((1, 2, 3)))}
    req = urllib.request.Request(server + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 method="POST", headers={"Authorization": "Bearer sk-test",
                                                          "Content-Type": "application/json"})  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and "image_url" in json.loads(e.value.read())["error"]["message"]


@pytest.fixture(scope="module")
def bomb_url():
    """A 1-bit PNG of 6,320 x 6,320 (just under the per-image pixel limit): a few KB encoded, 120 MB
    once decoded to RGB."""
    buf = io.BytesIO()
    Image.new("1", (6320, 6320)).save(buf, format="PNG")
    return _b64(buf.getvalue())


@pytest.mark.parametrize(
    ("count", "named"),
    [(20, "--max-images"), (3, "--max-image-pixels"), (2, "the context is 512 tokens")],
    ids=["count", "pixels", "context"],
)
def test_image_floods_are_refused_before_any_decoding(vl_server, bomb_url, count, named):
    """Every check that the headers can answer comes before the first pixel is decoded: 20 images
    (--max-images 16), 3 of 40 MP (--max-image-pixels 100 M), 2 whose tokens overflow the context. Each
    decode of such an image took seconds and 120 MB."""
    parts = [{"type": "image_url", "image_url": {"url": bomb_url}}] * count + [{"type": "text", "text": "hi"}]
    t0 = time.perf_counter()
    status, body = post(vl_server, [{"role": "user", "content": parts}])
    took = time.perf_counter() - t0
    assert status == 400 and named in body["error"]["message"], body
    assert took < 1.0, took
    status, body = post(vl_server, image_message(png_url((30, 30, 220))))
    assert status == 200, body
