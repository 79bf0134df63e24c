"""Images in the engine and the server: a VL checkpoint served as its language model plus a vision
front end that turns a request's image_url parts into prompt ids and per-image embedding spans.

    urls --data_url_bytes, image_size (header only; limits; ImageError)--> ImageHeader (size, tokens)
    ImageHeader --decode_image (only for a prompt that fits)--> PIL --preprocess_image--> ImageInput, hash
    chat segments + images --encode_segments_with_images--> ids (one <|media_pad|> run per image)
    vision_tower + mm_projector (packed) --> [M, D] --split per image--> MediaSpan(start of run, rows, hash)

The engine runs `language_model` (K3ForCausalLM) and feeds each span's rows at its pad positions
(`k3.infer.media`); the spans' hashes key the prefix cache. The tower runs outside the engine thread,
once per request, under a lock (one image batch at a time).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from k3.infer.media import MediaSpan
from k3.model.multimodal import K3VLForCausalLM
from k3.vision.image_io import ImageError, ImageLimits, data_url_bytes, decode_image, image_hash, image_size
from k3.vision.media import check_media_counts, encode_segments_with_images
from k3.vision.preprocess import ImageInput, batch_images, num_image_tokens, preprocess_image


@dataclass(frozen=True)
class ImageHeader:
    """An upload read as far as its header: the encoded bytes, its size and its token count."""

    data: bytes
    size: tuple[int, int]  # (W, H)
    num_tokens: int

    @property
    def pixels(self) -> int:
        return self.size[0] * self.size[1]


@dataclass(frozen=True)
class PreparedImage:
    image: ImageInput
    key: str  # image_hash of the decoded pixels


class VisionFrontend:
    """The vision half of a K3VLForCausalLM for serving: decode, pre-process, encode ids, embed."""

    def __init__(self, model: K3VLForCausalLM, limits: ImageLimits | None = None):
        self.vision_tower, self.mm_projector = model.vision_tower.eval(), model.mm_projector.eval()
        self.media, self.pad_id = model.config.media, model.pad_id
        self.limits = limits or ImageLimits()
        self._lock = threading.Lock()

    def headers(self, urls: list) -> list[ImageHeader]:
        """data: URLs -> their bytes, sizes and token counts, no pixel decoded (ImageError for a bad
        one, or one over the limits)."""
        out = []
        for url in urls:
            data = data_url_bytes(url, self.limits)
            w, h = image_size(data, self.limits)
            out.append(ImageHeader(data, (w, h), num_image_tokens(w, h, self.media)))
        return out

    def load(self, images: list) -> list[PreparedImage]:
        """ImageHeaders (or data: URLs) -> decoded, pre-processed, hashed images, one at a time (only
        one decoded image is alive at once); ImageError for a bad one."""
        out = []
        for item in images:
            head = item if isinstance(item, ImageHeader) else self.headers([item])[0]
            img = decode_image(head.data, self.limits)
            if img.size != head.size:
                raise ImageError("not_an_image", f"image decodes to {img.size}, its header says {head.size}")
            out.append(PreparedImage(preprocess_image(img, self.media), image_hash(img)))
            del img
        return out

    def encode(self, tokenizer, segments, images: list) -> list[int]:
        """Rendered chat segments (one placeholder per image) -> prompt ids with the media tokens;
        `images`: PreparedImages or ImageHeaders (the same ids: sizes and token counts agree)."""
        sizes = [(p.size, p.num_tokens) if isinstance(p, ImageHeader) else (p.image.orig_size,
                 p.image.num_tokens) for p in images]  # fmt: skip
        return encode_segments_with_images(tokenizer, segments, sizes)

    @torch.no_grad()
    def spans(self, ids: list[int], images: list[PreparedImage]) -> tuple[MediaSpan, ...]:
        """One MediaSpan per image: its pad run's start in `ids`, its projected rows [n_i, D], its hash."""
        if not images:
            return ()
        check_media_counts([ids], self.pad_id, [p.image.num_tokens for p in images])
        pixels, grid = batch_images([p.image for p in images])
        dtype = self.vision_tower.patch_embed.proj.weight.dtype
        with self._lock:
            rows = self.mm_projector(self.vision_tower(pixels.to(dtype), grid))
        starts = [i for i, t in enumerate(ids) if t == self.pad_id and (i == 0 or ids[i - 1] != self.pad_id)]
        parts = rows.split([p.image.num_tokens for p in images])
        return tuple(MediaSpan(s, r, p.key) for s, r, p in zip(starts, parts, images, strict=True))


def is_vl_checkpoint(ckpt_dir: str | Path) -> bool:
    """Whether `ckpt_dir/config.json` has a vision_config (a K3 VL checkpoint)."""
    cfg = Path(ckpt_dir) / "config.json"
    return cfg.exists() and "vision_config" in json.loads(cfg.read_text())


def load_vl_engine(ckpt_dir: str | Path, config=None, device: str = "cpu", limits: ImageLimits | None = None):
    """Engine over the checkpoint's language model, with `.vision` = its VisionFrontend."""
    from k3.checkpoint.vl import load_vl_checkpoint
    from k3.infer.engine import Engine
    from k3.tokenizer import K3Tokenizer

    model = load_vl_checkpoint(ckpt_dir, device=device).eval()
    d = Path(ckpt_dir)
    tok = K3Tokenizer.from_dir(d) if (d / "tokenizer_config.json").exists() else None
    engine = Engine(model.language_model, config, tokenizer=tok)
    engine.vision = VisionFrontend(model, limits)
    return engine
