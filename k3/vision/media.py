"""Media placeholder expansion (docs/spec_vision.md#placement): token ids around each image, and the count
checks.

The chat renderer writes the plain text `<|kimi_image_placeholder|>` once per image. Before the model
runs, each occurrence becomes

    <|media_begin|> "image {W}x{H}" <|media_content|> N x <|media_pad|> <|media_end|>

with W x H the upload size and N = `num_image_tokens` of the image; only the N pad positions receive
projector outputs (`k3.model.multimodal.scatter_image_embeddings`). The text between placeholders is
encoded with specials disallowed, so user text cannot forge media tokens. Pure Python on a
`K3Tokenizer`; no torch needed, so the server can use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from k3.vision.config import IMAGE_PLACEHOLDER


@dataclass(frozen=True)
class MediaIds:
    begin: int
    content: int
    end: int
    pad: int

    @classmethod
    def of(cls, tokenizer) -> MediaIds:
        t = tokenizer.token_to_id
        return cls(t("<|media_begin|>"), t("<|media_content|>"), t("<|media_end|>"), t("<|media_pad|>"))


def image_token_ids(tokenizer, orig_size: tuple[int, int], num_tokens: int) -> list[int]:
    """The ids that stand for one image of upload size (W, H) with `num_tokens` LLM tokens."""
    if not (isinstance(num_tokens, int) and num_tokens > 0):
        raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
    w, h = orig_size
    ids = MediaIds.of(tokenizer)
    header = tokenizer.encode(f"image {int(w)}x{int(h)}")
    return [ids.begin, *header, ids.content, *([ids.pad] * num_tokens), ids.end]


def expand_image_placeholders(
    tokenizer,
    text: str,
    images: Sequence[tuple[tuple[int, int], int]],
    placeholder: str = IMAGE_PLACEHOLDER,
    allow_special: bool = False,
) -> list[int]:
    """Encode `text`, replacing its i-th `placeholder` by `image_token_ids(tokenizer, *images[i])`.

    images: one (orig_size (W, H), num_tokens) per placeholder, in order. `allow_special` applies to the
    text pieces (True for rendered chat markup whose user parts were already escaped by the renderer).
    """
    pieces = text.split(placeholder)
    if len(pieces) - 1 != len(images):
        raise ValueError(
            f"text holds {len(pieces) - 1} image placeholder(s) {placeholder!r} "
            f"but {len(images)} image(s) were given"
        )
    out: list[int] = []
    for i, piece in enumerate(pieces):
        if piece:
            out += tokenizer.encode(piece, allow_special=allow_special)
        if i < len(images):
            size, n = images[i]
            out += image_token_ids(tokenizer, size, n)
    return out


def pad_runs(ids: Sequence[int], pad_id: int) -> list[int]:
    """Lengths of the maximal runs of `pad_id` in `ids`, in order (one run per image)."""
    runs, n = [], 0
    for i in ids:
        if i == pad_id:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs + ([n] if n else [])


def check_media_counts(rows: Sequence[Sequence[int]], pad_id: int, tokens_per_image: Sequence[int]) -> None:
    """Each image's pad run (rows in order, each row scanned left to right) must match its token count."""
    runs = [r for row in rows for r in pad_runs(row, pad_id)]
    want = [int(n) for n in tokens_per_image]
    if runs != want:
        raise ValueError(
            f"input_ids hold <|media_pad|> runs {runs} (total {sum(runs)}) but the images give "
            f"{want} tokens (total {sum(want)}); one run of pads per image, in order"
        )


def encode_segments_with_images(
    tokenizer,
    segments: Sequence[tuple[str, bool]],
    images: Sequence[tuple[tuple[int, int], int]],
    placeholder: str = IMAGE_PLACEHOLDER,
) -> list[int]:
    """`k3.chat_format.encode_segments` with image placeholders in the text segments expanded.

    segments: [(text, is_marker)] from `k3.chat_format.render`; markers become their reserved ids, text is
    encoded with specials disallowed, and the i-th placeholder across all text segments becomes image i.
    """
    total = sum(text.count(placeholder) for text, marker in segments if not marker)
    if total != len(images):
        raise ValueError(
            f"messages hold {total} image placeholder(s) {placeholder!r} "
            f"but {len(images)} image(s) were given"
        )
    ids: list[int] = []
    used = 0
    for text, marker in segments:
        if marker:
            ids.append(tokenizer.token_to_id(text))
            continue
        k = text.count(placeholder)
        ids += expand_image_placeholders(tokenizer, text, images[used : used + k], placeholder)
        used += k
    return ids
