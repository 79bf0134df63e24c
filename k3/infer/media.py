"""Per-sequence input-embedding overrides (image tokens) for the engine.

A `MediaSpan` says: prompt positions [start, start + L) take `embeds` [L, D] instead of
`embed_tokens(ids)` there (one image's projected patches from the vision tower, `k3.infer.vision`),
and `key` (the image's content hash) enters the prefix-cache hash of every unit that overlaps the span
(`prefix_cache.chain_hashes`), so two different images never share cached state even though their
token ids (all <|media_pad|>) are equal. The model runner consumes the spans during prefill, whatever the
chunking and however much of the prompt came from the cache: each fed position [c, c + n) that falls in
a span takes that span's row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MediaSpan:
    start: int  # first prompt position the span covers
    embeds: torch.Tensor  # [L, D] rows for positions start .. start + L - 1
    key: str  # content hash (hex) of what produced the rows

    @property
    def stop(self) -> int:
        return self.start + self.embeds.shape[0]


def check_media(media: Sequence[MediaSpan], prompt_len: int, width: int) -> None:
    """Raise ValueError unless the spans are [L, width] rows, inside the prompt, ordered, disjoint."""
    end = 0
    for i, s in enumerate(media):
        if not isinstance(s, MediaSpan):
            raise ValueError(f"media[{i}] must be a MediaSpan, got {type(s).__name__}")
        if s.embeds.ndim != 2 or s.embeds.shape[1] != width or s.embeds.shape[0] == 0:
            raise ValueError(f"media[{i}].embeds must be [L>0, {width}], got {list(s.embeds.shape)}")
        if s.start < end or s.stop > prompt_len:
            raise ValueError(
                f"media[{i}] covers positions [{s.start}, {s.stop}): spans must be ordered, disjoint and "
                f"inside the {prompt_len}-token prompt"
            )
        if not (isinstance(s.key, str) and s.key):
            raise ValueError(f"media[{i}].key must be a non-empty string (the content hash)")
        end = s.stop


def embed_with_media(embed_tokens, ids: torch.Tensor, seqs, start: int) -> torch.Tensor:
    """ids [B, n] = positions [start, start + n) of each of `seqs` -> inputs_embeds [B, n, D] with every
    position inside one of a sequence's `media` spans taken from that span."""
    x = embed_tokens(ids)
    n = ids.shape[1]
    for b, seq in enumerate(seqs):
        for s in seq.media:
            lo, hi = max(start, s.start), min(start + n, s.stop)
            if lo < hi:
                x[b, lo - start : hi - start] = s.embeds[lo - s.start : hi - s.start].to(x)
    return x
