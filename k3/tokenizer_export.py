"""A K3Tokenizer as other runtimes read it: the release's ``tiktoken.model`` and llama.cpp's GGUF vocabulary,
and the GPT-2 byte-level spelling of tokens both use. It imports nothing from :mod:`k3.tokenizer`, which
builds on it (the functions take any object with the tokenizer's methods).

Ranks and merges. tiktoken's BPE repeatedly joins the adjacent pair whose concatenation has the lowest
rank; HF ``tokenizers`` and llama.cpp join the adjacent pair that comes first in a merge list. A trained
tokenizer exports ``rank = id``: the BPE trainer numbers each merge's product after the 256 byte tokens
in the order it learns the merges, so "lowest rank" and "first merge" pick the same pair and the two
algorithms give the same ids. :func:`rank_order_problems` checks the two properties this rests on (each
merge's product is a token, products are numbered in merge order, one merge per product); the tests
check the outcome against the ``tiktoken`` package on held-out text. The other way round, a vocabulary
given only as ranks (the official ``tiktoken.model``) gets its merges from :func:`merges_from_ranks`:
for each token, the last join tiktoken makes when it encodes the token's own bytes.

GGUF. :func:`gguf_vocab` gives what llama.cpp's ``gpt2``-model vocabulary keys hold: every token string
in GPT-2 byte-to-unicode form (reserved tokens by name), a token type per id, the merges as "a b" strings
and the ``kimi-k2`` pre-tokenizer name, which is llama.cpp's implementation of our split
(``k3.tokenizer.PRE_TOKENIZER_PATTERN``). As llama.cpp's converter does for the release's vocabulary,
every reserved id is a control token and unfilled ordinary ids are unused.
"""

from __future__ import annotations

import base64
import os
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: k3.tokenizer builds on this module, not the other way round
    from k3.tokenizer import K3Tokenizer

# llama.cpp's token types (gguf.TokenType)
NORMAL, CONTROL, UNUSED = 1, 3, 5
_UNUSED_NAME = re.compile(rb"<\|unused_(\d+)\|>")  # what train_tokenizer fills missing merges with


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (HF ``ByteLevel``, GGUF ``gpt2`` vocabularies): printable
    Latin-1 bytes stand for themselves, the other 68 take the characters from U+0100 on, in byte order."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    moved = [b for b in range(256) if b not in kept]
    return {b: chr(b) for b in kept} | {b: chr(0x100 + i) for i, b in enumerate(moved)}


_BYTE_TO_CHAR = byte_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in _BYTE_TO_CHAR.items()}


def token_string(token: bytes) -> str:
    """A token's bytes in GPT-2 byte-to-unicode form (how ``tokenizer.json`` and GGUF spell it)."""
    return "".join(_BYTE_TO_CHAR[b] for b in token)


def token_bytes(string: str) -> bytes:
    """Inverse of :func:`token_string`."""
    try:
        return bytes(_CHAR_TO_BYTE[c] for c in string)
    except KeyError as e:
        raise ValueError(f"token {string!r} holds {e.args[0]!r}, not a byte-level character") from None


def unused_ids(ranks: dict[bytes, int]) -> set[int]:
    """Ordinary ids that hold ``<|unused_ID|>`` fillers (a corpus too small for every merge)."""
    return {i for b, i in ranks.items() if (m := _UNUSED_NAME.fullmatch(b)) and int(m.group(1)) == i}


def rank_order_problems(tokenizer: K3Tokenizer) -> list[str]:
    """Why tiktoken (ranks = ids) could encode differently from the merge list; empty when it cannot."""
    ranks, merges = tokenizer.ranks(), tokenizer.merges()
    problems, last, seen = [], -1, set()
    for n, (a, b) in enumerate(merges):
        product = ranks.get(a + b)
        if a not in ranks or b not in ranks or product is None:
            problems.append(f"merge {n} ({a!r}, {b!r}) joins or makes a byte string that is not a token")
        elif product in seen:
            problems.append(f"merge {n} ({a!r}, {b!r}) makes token {product} a second time")
        elif product <= last:
            problems.append(f"merge {n} makes token {product}, numbered before the previous merge's {last}")
        else:
            seen.add(product)
            last = product
    want = sum(len(b) > 1 for b in ranks) - len(unused_ids(ranks))
    if not problems and len(seen) != want:
        problems.append(f"{want} multi-byte tokens but merges make {len(seen)} of them")
    return problems


def write_tiktoken_model(tokenizer: K3Tokenizer, path: str | os.PathLike) -> Path:
    """``path`` <- one ``<base64 token bytes> <rank>`` line per ordinary id, in id order (the release's
    ``tiktoken.model``). Warns if :func:`rank_order_problems` finds a reason tiktoken could disagree."""
    ranks = tokenizer.ranks()
    by_id = sorted(ranks.items(), key=lambda kv: kv[1])
    if [i for _, i in by_id] != list(range(tokenizer.base)):
        raise ValueError(f"ordinary tokens must have ids 0..{tokenizer.base - 1} exactly once")
    problems = rank_order_problems(tokenizer)
    if problems:
        warnings.warn(f"{path}: tiktoken may encode differently: {problems[0]}", stacklevel=2)
    path = Path(path)
    path.write_text("".join(f"{base64.b64encode(b).decode()} {i}\n" for b, i in by_id))
    return path


def _bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """tiktoken's join loop on ``token``'s bytes, stopped before any join of rank >= ``max_rank``."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, at = max_rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, at = r, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Merge list of a rank-only vocabulary, in rank order: token t's merge is the pair tiktoken's join
    loop leaves when it encodes t's bytes without joins of rank >= rank(t) (tokens it cannot reach
    that way get none)."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) > 1:
            parts = _bpe_parts(ranks, token, rank)
            if len(parts) == 2:
                merges.append((parts[0], parts[1]))
    return merges


@dataclass(frozen=True)
class GGUFVocab:
    """The GGUF ``tokenizer.ggml.*`` values of a K3 vocabulary (ids 0..vocab_size-1)."""

    tokens: list[str]  # tokenizer.ggml.tokens: byte-level strings; reserved tokens by name
    token_types: list[int]  # tokenizer.ggml.token_type: NORMAL, CONTROL (reserved) or UNUSED
    merges: list[str]  # tokenizer.ggml.merges: "a b", priority order
    model: str = "gpt2"  # tokenizer.ggml.model
    pre: str = "kimi-k2"  # tokenizer.ggml.pre
    special_ids: dict[str, int] = field(default_factory=dict)  # bos / eos / unk / pad -> id


def gguf_vocab(tokenizer: K3Tokenizer) -> GGUFVocab:
    """llama.cpp's view of ``tokenizer`` (see the module doc). Raises ValueError for a tokenizer whose
    pre-tokenizer is not Kimi K2's, which llama.cpp's ``kimi-k2`` type would cut differently."""
    if not tokenizer.kimi_split:
        raise ValueError(
            "tokenizer's pre-tokenizer is not Kimi K2's split (trained before k3 tokenizer format 2?): "
            "llama.cpp's kimi-k2 pre-tokenizer would tokenize differently; retrain the tokenizer"
        )
    ranks = tokenizer.ranks()
    unused = unused_ids(ranks)
    tokens = [""] * tokenizer.vocab_size
    types = [NORMAL] * tokenizer.vocab_size
    for b, i in ranks.items():
        tokens[i] = b.decode() if i in unused else token_string(b)
        types[i] = UNUSED if i in unused else NORMAL
    for t in tokenizer.reserved:
        tokens[t.id], types[t.id] = t.name, CONTROL
    merges = [f"{token_string(a)} {token_string(b)}" for a, b in tokenizer.merges()]
    special = dict(bos=tokenizer.bos_id, eos=tokenizer.eos_id, unk=tokenizer.unk_id, pad=tokenizer.pad_id)
    return GGUFVocab(tokens, types, merges, special_ids=special)
